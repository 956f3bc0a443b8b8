// Alerts: a subscription's firing and recent alerts (shown in its live view), and the
// Alerts page (every alert, the channels and the rules). Channels and rules are managed
// through the API by an admin (docs/operations.md#alerts); the page only shows them.

import { get } from "../api.js";
import { badge, errorBox, fill, fmt, h } from "../dom.js";

/** The last delivery attempt of an alert, as "200 (firing)" or its error. */
function lastDelivery(alert) {
  const last = alert.deliveries[alert.deliveries.length - 1];
  const pending = alert.delivery_status.find((d) => d.state === "pending");
  if (!last) {
    return pending ? h("span", { class: "muted" }, "pending")
      : h("span", { class: "muted" }, "no channel");
  }
  const ok = last.status != null && last.status >= 200 && last.status < 300;
  return h("span", { class: ok ? null : "error-text", title: last.error || "" },
    `${last.status == null ? "no answer" : last.status} (${last.event}, ${last.channel})`,
    ok || !last.error ? null : ` — ${last.error}`);
}

function alertRow(alert, withSubscription) {
  return h("tr", { "data-test": "alert", "data-state": alert.state },
    h("td", {}, h("strong", {}, alert.rule), " ", h("span", { class: "muted" }, alert.kind)),
    withSubscription ? h("td", { class: "mono" }, alert.subject) : null,
    h("td", {}, badge(alert.state, alert.state === "firing" ? "error" : "done")),
    h("td", {}, alert.summary, alert.detail ? h("div", { class: "muted" }, alert.detail) : null),
    h("td", {}, fmt.time(alert.started_at)),
    h("td", {}, fmt.time(alert.resolved_at)),
    h("td", { "data-test": "alert-delivery" }, lastDelivery(alert)));
}

function alertTable(alerts, withSubscription) {
  const head = ["Rule", withSubscription ? "Subject" : null, "State", "Summary", "Started",
    "Resolved", "Last delivery"].filter(Boolean);
  return h("table", { class: "grid-table", "data-test": "alerts" },
    h("thead", {}, h("tr", {}, head.map((c) => h("th", {}, c)))),
    h("tbody", {}, alerts.length ? alerts.map((a) => alertRow(a, withSubscription))
      : h("tr", {}, h("td", { colspan: head.length, class: "muted" }, "No alerts."))));
}

/** A card with the subscription's firing and recent alerts, refreshed every 10 s. */
export function subscriptionAlerts(ctx, subscriptionId) {
  const body = h("div");
  const card = h("section", { class: "card", "data-test": "subscription-alerts" },
    h("div", { class: "title-row" }, h("h3", {}, "Alerts"),
      h("a", { href: "#/alerts" }, "all alerts, channels and rules")),
    body);
  ctx.poll(async () => {
    try {
      const alerts = await get(`/alerts?subscription_id=${encodeURIComponent(subscriptionId)}` +
        "&limit=20", { signal: ctx.signal });
      if (ctx.active) fill(body, alertTable(alerts, true));
    } catch (err) {
      if (ctx.active) fill(body, errorBox(err));
    }
  }, 10000);
  return card;
}

export async function alertsView(root, ctx) {
  const alertsBody = h("div");
  const channelsBody = h("tbody");
  const rulesBody = h("tbody");
  root.append(
    h("section", { class: "card" }, h("h2", {}, "Alerts"),
      h("p", { class: "muted" }, "Firing alerts, then those resolved in the last 7 days. ",
        "Rules and channels are managed through the API (admin): ",
        h("code", {}, "/api/v1/alerts/rules"), ", ", h("code", {}, "/api/v1/alerts/channels"),
        "."),
      alertsBody),
    h("section", { class: "card" }, h("h3", {}, "Rules"),
      h("table", { class: "grid-table", "data-test": "alert-rules" },
        h("thead", {}, h("tr", {}, ["Name", "Kind", "Subscription", "Threshold", "For",
          "Repeat", "Channels"].map((c) => h("th", {}, c)))),
        rulesBody)),
    h("section", { class: "card" }, h("h3", {}, "Channels"),
      h("table", { class: "grid-table", "data-test": "alert-channels" },
        h("thead", {}, h("tr", {}, ["Name", "Kind", "Format", "URL", "Signed"].map((c) =>
          h("th", {}, c)))),
        channelsBody)));

  const [channels, rules, subs] = await Promise.all([
    get("/alerts/channels"), get("/alerts/rules"), get("/subscriptions").catch(() => [])]);
  const channelName = Object.fromEntries(channels.map((c) => [c.id, c.name]));
  const subName = Object.fromEntries(subs.map((s) => [s.id, s.name]));
  fill(channelsBody, channels.length ? channels.map((c) => h("tr", { "data-test": "channel" },
    h("td", {}, c.name), h("td", {}, c.kind), h("td", {}, c.format),
    h("td", { class: "mono" }, c.url), h("td", {}, c.has_secret ? "yes" : "no")))
    : h("tr", {}, h("td", { colspan: 5, class: "muted" }, "No channels.")));
  fill(rulesBody, rules.length ? rules.map((r) => h("tr", { "data-test": "rule" },
    h("td", {}, r.name), h("td", {}, r.kind),
    h("td", {}, r.subscription_id ? (subName[r.subscription_id] || r.subscription_id)
      : h("span", { class: "muted" }, "default (all)")),
    h("td", { class: "num" }, r.effective.threshold == null ? "—" : String(r.effective.threshold)),
    h("td", { class: "num" }, fmt.seconds(r.effective.for_seconds)),
    h("td", { class: "num" }, r.effective.repeat_seconds ? fmt.seconds(r.effective.repeat_seconds)
      : "never"),
    h("td", {}, r.channels.map((id) => channelName[id] || id).join(", ") || "—")))
    : h("tr", {}, h("td", { colspan: 7, class: "muted" }, "No rules.")));

  ctx.poll(async () => {
    const alerts = await get("/alerts?limit=200", { signal: ctx.signal });
    if (ctx.active) fill(alertsBody, alertTable(alerts, true));
  }, 10000);
}
