// Targets: where replicated rows land.

import { del, get, post } from "../api.js";
import { errorBox, fill, field, h, submitting } from "../dom.js";

export async function targetsView(root, ctx) {
  const tbody = h("tbody");
  const message = h("div");
  const reload = async () => {
    const targets = await get("/targets", { signal: ctx.signal });
    if (!ctx.active) return;
    fill(tbody, ...targets.map((t) => h("tr", { "data-test": `target-${t.name}` },
      h("td", {}, t.name), h("td", {}, t.kind), h("td", { class: "mono" }, t.dsn),
      h("td", {}, t.server_version || "—"),
      h("td", {}, h("button", { type: "button", class: "small danger", onclick: async () => {
        if (!confirm(`Forget target ${t.name}?`)) return;
        try {
          await del(`/targets/${t.id}`);
          await reload();
        } catch (err) {
          fill(message, errorBox(err));
        }
      } }, "Remove")))));
    if (!targets.length) {
      tbody.append(h("tr", {}, h("td", { colspan: 5, class: "muted" }, "No targets yet.")));
    }
  };
  const form = h("form", { class: "card form", "data-test": "create-target" },
    h("h3", {}, "Add a target"),
    field("Name", h("input", { name: "name", required: true, maxlength: 63 })),
    field("DSN", h("input", { name: "dsn", required: true, autocomplete: "off",
      placeholder: "postgresql://user:password@host:5432/db" }),
    "a PostgreSQL database; the password is stored encrypted and never shown"),
    h("button", { type: "submit" }, "Add target"));
  root.append(
    h("section", { class: "card" }, h("h2", {}, "Targets"), message,
      h("table", { class: "grid-table", "data-test": "targets" },
        h("thead", {}, h("tr", {}, ["Name", "Kind", "DSN", "Server", ""].map((c) => h("th", {}, c)))),
        tbody)),
    submitting(form, async (data) => {
      await post("/targets", { name: data.get("name").trim(), kind: "postgres",
        dsn: data.get("dsn") });
      form.reset();
      await reload();
    }));
  await reload();
}
