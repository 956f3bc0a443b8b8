// Sources and their replication slots, coloured by health (orphaned, inactive, nearing
// max_slot_wal_keep_size, lost), with the projected time to invalidation.

import { del, get, post } from "../api.js";
import { badge, fill, errorBox, field, fmt, h, submitting } from "../dom.js";

function slotRow(sourceId, slot, reload, message) {
  const owner = slot.owned_by
    ? h("span", {}, "subscription ", h("code", {}, slot.owned_by))
    : slot.orphaned ? badge("orphaned", "critical") : h("span", { class: "muted" }, "—");
  return h("tr", { class: `health-${slot.health}`, "data-test": `slot-${slot.name}` },
    h("td", {}, h("span", { class: `dot dot-${slot.health}`, title: slot.health }),
      h("code", {}, slot.name)),
    h("td", {}, slot.active ? badge("active", "ok")
      : slot.in_use ? h("span", { title: "a running consumer or sync job uses it between reads" },
        badge("in use", "ok")) : badge("inactive", "idle")),
    h("td", {}, owner),
    h("td", {}, slot.wal_status || "—"),
    h("td", { class: "num" }, fmt.bytes(slot.retained_wal_bytes)),
    h("td", { class: "num" }, slot.safe_wal_size == null ? "unlimited" : fmt.bytes(slot.safe_wal_size)),
    h("td", { class: "num" }, slot.projected_invalidation_seconds == null ? "—"
      : fmt.seconds(slot.projected_invalidation_seconds)),
    h("td", { class: "warnings" }, slot.warnings.map((w) =>
      h("div", { class: `warn-line warn-${w.code}`, title: w.code }, w.message))),
    h("td", {}, slot.active ? null : h("button", { type: "button", class: "small danger",
      onclick: async () => {
        if (!confirm(`Drop replication slot ${slot.name}? A subscription using it must resync.`)) return;
        try {
          await del(`/sources/${sourceId}/slots/${encodeURIComponent(slot.name)}`);
          await reload();
        } catch (err) {
          fill(message, errorBox(err));
        }
      } }, "Drop")));
}

function sourceCard(source, ctx) {
  const healthBadge = h("span", {}, badge("…", "idle"));
  const facts = h("p", { class: "muted" });
  const message = h("div");
  const tbody = h("tbody");
  const card = h("section", { class: "card", "data-test": `source-${source.name}` },
    h("div", { class: "title-row" },
      h("h3", {}, source.name), healthBadge,
      h("div", { class: "actions" }, h("button", { type: "button", class: "small danger",
        onclick: async () => {
          if (!confirm(`Forget source ${source.name}? (Nothing is dropped on the server.)`)) return;
          try {
            await del(`/sources/${source.id}`);
            card.remove();
          } catch (err) {
            fill(message, errorBox(err));
          }
        } }, "Remove"))),
    h("p", { class: "mono muted" }, source.dsn, ` · PostgreSQL ${source.server_version || "?"}`),
    facts, message,
    h("table", { class: "grid-table slots" },
      h("thead", {}, h("tr", {}, ["Slot", "", "Owned by", "wal_status", "Retained WAL",
        "Safe WAL left", "Invalidated in", "Warnings", ""].map((c) => h("th", {}, c)))),
      tbody));

  const reload = async () => {
    const health = await get(`/sources/${source.id}/health`, { signal: ctx.signal });
    if (!ctx.active) return;
    fill(healthBadge, badge(health.health));
    if (!health.reachable) {
      fill(facts, h("span", { class: "error" }, `unreachable: ${health.error}`));
    } else {
      fill(facts,
        `WAL at ${health.wal_lsn}`,
        health.wal_rate_bytes_per_second == null ? ""
          : ` · writing ${fmt.bytes(health.wal_rate_bytes_per_second)}/s`,
        ` · max_slot_wal_keep_size ${health.max_slot_wal_keep_size == null
          ? "unlimited" : fmt.bytes(health.max_slot_wal_keep_size)}`);
    }
    fill(tbody, ...health.slots.map((s) => slotRow(source.id, s, reload, message)));
    if (!health.slots.length) {
      tbody.append(h("tr", {}, h("td", { colspan: 9, class: "muted" }, "no replication slots")));
    }
  };
  ctx.poll(reload, 10000);
  return card;
}

export async function sourcesView(root, ctx) {
  const sources = await get("/sources");
  const list = h("div", { "data-test": "sources" });
  list.append(...sources.map((s) => sourceCard(s, ctx)));
  if (!sources.length) list.append(h("p", { class: "card muted" }, "No sources yet."));
  const form = h("form", { class: "card form", "data-test": "create-source" },
    h("h3", {}, "Add a source"),
    field("Name", h("input", { name: "name", required: true, maxlength: 63 })),
    field("DSN", h("input", { name: "dsn", required: true, autocomplete: "off",
      placeholder: "postgresql://user:password@host:5432/db" }),
    "PostgreSQL 15+ with wal_level = logical; the password is stored encrypted and never shown"),
    h("button", { type: "submit" }, "Add source"));
  root.append(h("h2", {}, "Sources & slots"), list, submitting(form, async (data) => {
    const source = await post("/sources", { name: data.get("name").trim(), dsn: data.get("dsn") });
    form.reset();
    list.querySelector(".muted")?.remove();
    list.append(sourceCard(source, ctx));
  }));
}
