// Publications of a source, and the editor: each table's row filter is validated and
// tried on the source's real rows as you type (debounced POST /filter-preview). Editing
// an existing publication shows, before saving, what the change does to every
// subscription using it (debounced POST …/plan): rows added and removed per table, and
// saving reconciles the targets with a diff job unless told not to.

import { del, get, patch, post } from "../api.js";
import { badge, fill, debounce, errorBox, field, fmt, h, submitting } from "../dom.js";

const OPERATIONS = ["insert", "update", "delete", "truncate"];
const PREVIEW_DELAY_MS = 350;
const PLAN_DELAY_MS = 600;
const OUTCOMES = [
  ["update", "sent as UPDATE (old and new rows match)"],
  ["insert", "sent as INSERT (only the new row matches)"],
  ["delete", "sent as DELETE (only the old row matches)"],
  ["dropped", "not sent (neither matches)"],
  ["undetermined", "undetermined (old row not known)"],
  ["error", "evaluation error"],
];

function sampleTable(rows) {
  if (!rows.length) return h("p", { class: "muted" }, "no matching rows to show");
  const columns = Object.keys(rows[0]);
  return h("table", { class: "grid-table sample", "data-test": "preview-sample" },
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", {}, c)))),
    h("tbody", {}, rows.map((r) => h("tr", {}, columns.map((c) =>
      h("td", { class: r[c] == null ? "null" : null }, r[c] == null ? "NULL"
        : typeof r[c] === "object" ? JSON.stringify(r[c]) : String(r[c])))))));
}

function updateTable(ut) {
  if (!ut) return null;
  const rows = OUTCOMES.filter(([key]) => key in ut.counts).map(([key, label]) =>
    h("tr", { "data-test": `update-${key}` }, h("td", {}, label),
      h("td", { class: "num" }, fmt.count(ut.counts[key]))));
  return h("div", { class: "update-preview", "data-test": "preview-updates" },
    h("h4", {}, `Recent UPDATEs of ${ut.table} (${fmt.count(ut.images)} recorded)`),
    ut.update_published ? null : h("p", { class: "warning" }, "UPDATE is not published: none would be sent"),
    h("table", { class: "grid-table" }, h("tbody", {}, rows)),
    ut.notes.map((n) => h("p", { class: "muted" }, n)));
}

export function renderPreview(panel, result) {
  const pct = result.total_rows ? (100 * (result.matching_rows || 0)) / result.total_rows : null;
  const approx = result.estimated ? "≈ " : "";
  const status = result.valid
    ? h("span", { class: "ok", "data-test": "preview-status" }, "✓ valid")
    : h("span", { class: "bad", "data-test": "preview-status" }, "✗ not a valid row filter");
  fill(panel,
    h("div", { class: "preview-head" }, status,
      result.normalized ? h("span", { class: "muted" }, " as ", h("code", {}, result.normalized)) : null),
    result.errors.length ? h("ul", { class: "issues errors", "data-test": "preview-errors" },
      result.errors.map((e) => h("li", {}, h("code", {}, e.code), " ", e.message,
        e.position != null ? ` (at character ${e.position})` : ""))) : null,
    result.warnings.length ? h("ul", { class: "issues warnings" },
      result.warnings.map((w) => h("li", {}, h("code", {}, w.code), " ", w.message))) : null,
    result.total_rows != null ? h("p", { class: "counts", "data-test": "preview-counts" },
      "matching ", h("strong", { "data-test": "preview-matching" }, approx + fmt.count(result.matching_rows)),
      " of ", h("strong", { "data-test": "preview-total" }, approx + fmt.count(result.total_rows)),
      " rows", pct == null ? "" : ` (${pct.toFixed(1)}%)`,
      " · ", h("strong", { "data-test": "preview-null" }, approx + fmt.count(result.null_rows)),
      " where the filter is NULL (not replicated)",
      result.estimated ? h("span", { class: "muted" }, " — estimated from a sample") : null) : null,
    result.replica_identity ? h("p", { class: "muted" }, "replica identity: ",
      result.replica_identity.kind,
      result.replica_identity.columns?.length ? ` (${result.replica_identity.columns.join(", ")})` : "")
      : null,
    // counted despite an error (a filter invalid only for the replica identity): show its rows too
    result.valid || result.total_rows != null ? sampleTable(result.sample || []) : null,
    updateTable(result.update_transformations));
}

function tableRow(getContext, onRemove, initial = null, onChange = null) {
  const table = h("input", { name: "table", required: true, placeholder: "public.orders",
    "data-test": "table-input", autocomplete: "off", value: initial ? initial.table : "" });
  const where = h("textarea", { name: "where", rows: 2, spellcheck: "false",
    placeholder: "region = 'eu'   (empty: every row)", "data-test": "filter-input" });
  if (initial && initial.where) where.value = initial.where;
  const columns = h("input", { name: "columns", placeholder: "all columns (or: id, region, …)",
    autocomplete: "off", value: initial && initial.columns ? initial.columns.join(", ") : "" });
  const panel = h("div", { class: "preview", "data-test": "preview" },
    h("span", { class: "muted" }, "type a filter to try it on the source's rows"));
  let inflight = null;

  const show = (...children) => {
    panel.classList.remove("stale");
    fill(panel, ...children);
  };
  const run = debounce(async () => {
    const { sourceId, publish, subscriptionId } = getContext();
    const text = where.value.trim();
    if (inflight) inflight.abort();
    if (!table.value.trim() || !text) {
      show(h("span", { class: "muted" },
        text ? "name the table to preview" : "no filter: every row of the table is published"));
      return;
    }
    inflight = new AbortController();
    const body = { table: table.value.trim(), where: text, publish, sample_size: 5 };
    if (subscriptionId) body.subscription_id = subscriptionId;
    try {
      const result = await post(`/sources/${sourceId}/filter-preview`, body,
        { signal: inflight.signal });
      panel.classList.remove("stale");
      renderPreview(panel, result);
    } catch (err) {
      if (err.name === "AbortError") return;
      show(errorBox(err));
    }
  }, PREVIEW_DELAY_MS);
  const changed = () => {
    if (!panel.classList.contains("stale")) {
      panel.classList.add("stale");
      panel.prepend(h("div", { class: "checking" }, "checking…"));
    }
    run();
  };
  for (const input of [table, where]) input.addEventListener("input", changed);
  if (onChange) for (const input of [table, where, columns]) input.addEventListener("input", onChange);

  const row = h("div", { class: "table-row", "data-test": "table-row" },
    h("div", { class: "table-inputs" },
      field("Table", table), field("Row filter (WHERE)", where), field("Columns", columns),
      h("button", { type: "button", class: "small link", onclick: () => { row.remove(); onRemove(); } },
        "remove")),
    panel);
  row.refresh = changed;
  row.value = () => ({
    table: table.value.trim(),
    where: where.value.trim() || null,
    columns: columns.value.trim()
      ? columns.value.split(",").map((c) => c.trim()).filter(Boolean) : null,
  });
  return row;
}

function publicationCard(sourceId, pub, reload, message) {
  const drift = pub.drift.length;
  return h("div", { class: "pub", "data-test": `publication-${pub.name}` },
    h("div", { class: "title-row" }, h("h4", {}, pub.name),
      pub.live ? (drift ? badge(`${drift} drift`, "warning") : badge("in sync", "ok"))
        : badge("missing on source", "critical"),
      pub.managed ? null : badge("unmanaged", "idle"),
      h("div", { class: "actions" }, pub.managed ? h("button", { type: "button", class: "small",
        "data-test": `edit-${pub.name}`, onclick: (e) => {
          const card = e.target.closest(".pub");
          if (card.querySelector(".pub-editor")) return;
          card.append(publicationEditor(sourceId, pub, reload));
        } }, "Edit") : null, h("button", { type: "button", class: "small danger",
        onclick: async () => {
          if (!confirm(`Drop publication ${pub.name} on the source?`)) return;
          try {
            await del(`/sources/${sourceId}/publications/${encodeURIComponent(pub.name)}`);
            await reload();
          } catch (err) {
            fill(message, errorBox(err));
          }
        } }, "Drop"))),
    h("p", { class: "muted" }, "publishes ", pub.publish.join(", "),
      pub.all_tables ? " · FOR ALL TABLES" : "",
      pub.schemas.length ? ` · schemas ${pub.schemas.join(", ")}` : "",
      pub.publish_via_partition_root ? " · via partition root" : ""),
    pub.tables.length ? h("ul", { class: "pub-tables" }, pub.tables.map((t) => h("li", {},
      h("code", {}, t.table), t.where ? [" WHERE ", h("code", {}, t.where)] : " (all rows)",
      t.columns ? ` · columns ${t.columns.join(", ")}` : ""))) : null,
    drift ? h("ul", { class: "issues warnings" }, pub.drift.map((d) => h("li", {}, d.message)))
      : null);
}

function planSummary(plan) {
  const subs = plan.subscriptions;
  if (!subs.length) return h("p", { class: "muted" }, "no subscription uses this publication");
  const approx = (s) => (s.estimated ? "~" : "");
  return subs.map((s) => {
    const tables = s.tables;
    if (!tables.length) {
      return h("p", { class: "muted", "data-test": `plan-${s.subscription}` },
        `no change to the rows of subscription ${s.subscription}`);
    }
    return h("div", { class: "plan-sub", "data-test": `plan-${s.subscription}` },
      h("p", {}, "this change will ",
        h("strong", { "data-test": "plan-add" }, `add ${approx(s)}${fmt.count(s.add)} rows`), " and ",
        h("strong", { "data-test": "plan-remove" }, `remove ${approx(s)}${fmt.count(s.remove)} rows`),
        ` in subscription ${s.subscription}`,
        s.estimated ? h("span", { class: "muted" }, " (estimated from a sample)") : null),
      h("table", { class: "grid-table" },
        h("thead", {}, h("tr", {}, ["Table", "Filter before", "Filter after", "Add", "Remove",
          "Unchanged", "Columns", "On save"].map((c) => h("th", {}, c)))),
        h("tbody", {}, tables.map((t) => h("tr", {},
          h("td", { class: "mono" }, t.table),
          h("td", {}, h("code", {}, t.before ? t.before.filter || "all rows" : "not published")),
          h("td", {}, h("code", {}, t.after ? t.after.filter || "all rows" : "not published")),
          ...["add", "remove", "unchanged"].map((k) => h("td", { class: "num" },
            (t.rows.estimated ? "~" : "") + fmt.count(t.rows[k]))),
          h("td", {}, t.added_columns.length ? `backfill ${t.added_columns.join(", ")}` : "",
            t.removed_columns.length ? ` no longer sent: ${t.removed_columns.join(", ")}` : ""),
          h("td", {}, t.reconcile))))));
  });
}

function publicationEditor(sourceId, pub, reload) {
  const rows = h("div", { class: "table-rows" });
  const planPanel = h("div", { class: "plan", "data-test": "plan" },
    h("span", { class: "muted" }, "change a filter or column list to see what it does"));
  const reconcile = h("input", { type: "checkbox", name: "reconcile", checked: true,
    "data-test": "reconcile" });
  const path = `/sources/${sourceId}/publications/${encodeURIComponent(pub.name)}`;
  const body = () => ({
    tables: [...rows.querySelectorAll(".table-row")].map((r) => r.value()),
  });
  let inflight = null;
  const plan = debounce(async () => {
    if (inflight) inflight.abort();
    inflight = new AbortController();
    planPanel.classList.add("stale");
    try {
      const result = await post(`${path}/plan`, body(), { signal: inflight.signal });
      planPanel.classList.remove("stale");
      fill(planPanel, ...[planSummary(result)].flat());
    } catch (err) {
      if (err.name === "AbortError") return;
      planPanel.classList.remove("stale");
      fill(planPanel, errorBox(err));
    }
  }, PLAN_DELAY_MS);
  const context = () => ({ sourceId, publish: pub.publish, subscriptionId: null });
  for (const t of pub.tables) rows.append(tableRow(context, plan, t, plan));
  const editor = h("form", { class: "pub-editor form", "data-test": `editor-${pub.name}` },
    rows,
    h("button", { type: "button", class: "link", onclick: () => {
      rows.append(tableRow(context, plan, null, plan));
    } }, "+ add a table"),
    h("h4", {}, "What this change does"),
    planPanel,
    field("Reconcile the targets", h("label", { class: "check" }, reconcile,
      "diff: bring each subscription's tables to the new filter (rows added and removed, "
      + "nothing else rewritten)"),
    "unchecked: as PostgreSQL — the new filter applies to later changes only"),
    h("div", { class: "actions" },
      h("button", { type: "submit", "data-test": "save-publication" }, "Save"),
      h("button", { type: "button", class: "link", onclick: () => editor.remove() }, "Cancel")));
  submitting(editor, async () => {
    const out = await patch(path, { ...body(), reconcile: reconcile.checked ? "diff" : "none" });
    const how = (r) => {
      if (r.method !== "moved_rows") return `${r.tables.join(", ")}, compared whole`;
      const whole = r.diff_tables || [];
      const moved = r.tables.filter((t) => !whole.includes(t));
      return `${moved.join(", ")}, only the rows that move`
        + (whole.length ? `; then ${whole.join(", ")}, compared whole` : "");
    };
    const started = (out.reconcile || []).map((r) => h("li", {},
      r.job_id ? ["reconciling ", h("a", { href: `#/subscriptions/${r.subscription_id}` },
        r.subscription), ` (${how(r)}): job ${r.job_id}`]
        : `${r.subscription}: ${r.error}`));
    await reload();
    if (started.length) {
      const note = document.querySelector(`[data-test="publication-${pub.name}"]`);
      if (note) note.append(h("ul", { class: "reconcile-jobs", "data-test": "reconcile-jobs" }, started));
    }
  });
  plan();
  return editor;
}

export async function publicationsView(root, ctx) {
  const sources = await get("/sources");
  if (!sources.length) {
    root.append(h("section", { class: "card" }, h("h2", {}, "Publications"),
      h("p", {}, "Add a source first (", h("a", { href: "#/sources" }, "Sources"), ").")));
    return;
  }
  const sourceSelect = h("select", { "data-test": "pub-source" },
    sources.map((s) => h("option", { value: s.id }, s.name)));
  const list = h("div", { "data-test": "publications" });
  const message = h("div");
  const subSelect = h("select", { name: "subscription_id", "data-test": "update-subscription" });
  const rows = h("div", { class: "table-rows" });
  const publishBoxes = OPERATIONS.map((op) => h("input", { type: "checkbox", name: "publish",
    value: op, checked: true }));

  const context = () => ({
    sourceId: sourceSelect.value,
    publish: publishBoxes.filter((b) => b.checked).map((b) => b.value),
    subscriptionId: subSelect.value || null,
  });
  const refreshPreviews = () => rows.querySelectorAll(".table-row").forEach((r) => r.refresh());
  const addRow = () => rows.append(tableRow(context, () => {}));
  publishBoxes.forEach((b) => b.addEventListener("change", refreshPreviews));
  subSelect.addEventListener("change", refreshPreviews);

  const reload = async () => {
    const [pubs, subs] = await Promise.all([
      get(`/sources/${sourceSelect.value}/publications`, { signal: ctx.signal }),
      get("/subscriptions", { signal: ctx.signal }).catch(() => [])]);
    if (!ctx.active) return;
    fill(list, ...pubs.map((p) => publicationCard(sourceSelect.value, p, reload, message)));
    if (!pubs.length) list.append(h("p", { class: "muted" }, "No publications on this source yet."));
    const mine = subs.filter((s) => s.source_id === sourceSelect.value);
    fill(subSelect, h("option", { value: "" }, "— none —"),
      ...mine.map((s) => h("option", { value: s.id }, s.name)));
  };
  sourceSelect.addEventListener("change", () => {
    reload().catch((e) => fill(message, errorBox(e)));
    refreshPreviews();
  });

  const form = h("form", { class: "card form editor", "data-test": "publication-editor" },
    h("h3", {}, "New publication"),
    field("Name", h("input", { name: "name", required: true, maxlength: 63,
      pattern: "[A-Za-z0-9_][A-Za-z0-9_.\\-]*", "data-test": "pub-name" })),
    field("Publish", h("div", { class: "checks" }, publishBoxes.map((b) =>
      h("label", { class: "check" }, b, b.value)))),
    field("Try the filters on recent UPDATEs of", subSelect,
      "shows how each UPDATE would be sent (PostgreSQL's old/new row rule)"),
    rows,
    h("button", { type: "button", class: "link", onclick: addRow }, "+ add a table"),
    h("button", { type: "submit", "data-test": "create-publication" }, "Create publication"));
  addRow();

  root.append(
    h("section", { class: "card" },
      h("div", { class: "title-row" }, h("h2", {}, "Publications on"), sourceSelect),
      message, list),
    submitting(form, async (data) => {
      const tables = [...rows.querySelectorAll(".table-row")].map((r) => r.value());
      await post(`/sources/${sourceSelect.value}/publications`, {
        name: data.get("name").trim(), tables, publish: context().publish });
      form.querySelector("[name=name]").value = "";
      fill(rows);
      addRow();
      await reload();
    }));
  await reload();
}
