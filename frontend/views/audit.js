// Audit log: control-plane changes and failed authentications, newest first (admin only).

import { get } from "../api.js";
import { errorBox, fill, fmt, h } from "../dom.js";

const PAGE = 50;

export async function auditView(root, ctx) {
  const tbody = h("tbody");
  const message = h("div");
  const more = h("button", { type: "button", class: "small", "data-test": "audit-more" },
    "Older");
  const filter = h("input", { name: "resource", placeholder: "resource id (optional)",
    "data-test": "audit-resource", maxlength: 300 });
  let before = null;

  const row = (e) => h("tr", { "data-test": "audit-event" },
    h("td", {}, fmt.time(e.at)),
    h("td", {}, e.actor || h("span", { class: "muted" }, "(no valid token)")),
    h("td", { class: "mono" }, `${e.method} ${e.route}`,
      e.count > 1 ? h("span", { class: "muted" }, ` ×${e.count}`) : null),
    h("td", { class: "mono" }, e.resource_id || "—"),
    h("td", { class: e.status >= 400 ? "num error-text" : "num" },
      e.status == null ? "?" : String(e.status)),
    h("td", { class: "mono muted" }, e.request_id));

  const load = async (append) => {
    const params = new URLSearchParams({ limit: String(PAGE) });
    const resource = filter.value.trim();
    if (resource) params.set("resource", resource);
    if (append && before) params.set("before", String(before));
    try {
      const page = await get(`/audit?${params}`, { signal: ctx.signal });
      if (!ctx.active) return;
      fill(message);
      if (!append) tbody.replaceChildren();
      tbody.append(...page.events.map(row));
      if (!tbody.children.length) {
        tbody.append(h("tr", {}, h("td", { colspan: 6, class: "muted" }, "No events.")));
      }
      before = page.next_before;
      more.disabled = before == null;
    } catch (err) {
      if (!ctx.active) return;
      fill(message, errorBox(err.status === 403
        ? "the audit log is for admin tokens; this token's role is lower" : err));
    }
  };
  more.addEventListener("click", () => load(true));
  const form = h("form", { class: "inline" }, filter, h("button", { type: "submit",
    class: "small" }, "Filter"));
  form.addEventListener("submit", (event) => { event.preventDefault(); load(false); });

  root.append(h("section", { class: "card" }, h("h2", {}, "Audit log"),
    h("p", { class: "muted" }, "Every change made through the API (whatever its outcome) ",
      "and every request refused for its token. Never a request body or a secret."),
    form, message,
    h("table", { class: "grid-table", "data-test": "audit" },
      h("thead", {}, h("tr", {}, ["When", "Token", "Request", "Resource", "Status",
        "Request id"].map((c) => h("th", {}, c)))),
      tbody),
    more));
  await load(false);
}
