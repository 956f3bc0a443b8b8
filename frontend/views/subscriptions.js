// Subscriptions: the list (state, lag), creating one, and one subscription's live view:
// lag and LSN progress, the lag chart, per-table sync progress, enable/disable, resync
// (a copy, or a diff that writes only the differences), and the subscription's recent
// sync jobs — a reconciliation after a filter change among them — with their progress;
// its schema-change policy and the source DDL its stream met (followed or stopped).

import { del, get, post } from "../api.js";
import { lineChart } from "../chart.js";
import { subscriptionAlerts } from "./alerts.js";
import { badge, fill, errorBox, field, fmt, h, lsnValue, progressBar, submitting } from "../dom.js";

const TERMINAL_JOB_STATES = new Set(["succeeded", "done", "finished", "failed", "error",
  "cancelled", "canceled"]);

function lagCell(progress) {
  if (!progress) return "…";
  if (progress.lag_seconds == null) return "unknown";
  return fmt.seconds(progress.lag_seconds);
}

export async function subscriptionsView(root, ctx) {
  const [sources, targets] = await Promise.all([get("/sources"), get("/targets")]);
  const sourceName = Object.fromEntries(sources.map((s) => [s.id, s.name]));
  const targetName = Object.fromEntries(targets.map((t) => [t.id, t.name]));
  const tbody = h("tbody");
  const status = h("div");
  root.append(
    h("section", { class: "card" },
      h("h2", {}, "Subscriptions"),
      status,
      h("table", { class: "grid-table", "data-test": "subscriptions" },
        h("thead", {}, h("tr", {}, ["Name", "State", "Source → target", "Lag", "Behind",
          "Applied LSN", "Consumer"].map((c) => h("th", {}, c)))),
        tbody)),
    createForm(sources, targets));

  ctx.poll(async () => {
    let subs;
    try {
      subs = await get("/subscriptions", { signal: ctx.signal });
      fill(status);
    } catch (err) {
      if (ctx.active) fill(status, errorBox(err));
      return;
    }
    // Two at a time: the API gives a token a few places on the databases at once
    // (PGSIEVE_API_CONCURRENCY_PER_TOKEN); more in parallel would be refused with 429.
    const progress = await inTurns(subs, 2, (s) =>
      get(`/subscriptions/${s.id}/progress`, { signal: ctx.signal }).catch(() => null));
    if (!ctx.active) return;
    fill(tbody, ...subs.map((s, i) => {
      const p = progress[i];
      return h("tr", { "data-test": `subscription-${s.name}` },
        h("td", {}, h("a", { href: `#/subscriptions/${s.id}` }, s.name)),
        h("td", {}, badge(p ? p.state : s.state), s.enabled ? "" : " (disabled)"),
        h("td", {}, `${sourceName[s.source_id] || "?"} → ${targetName[s.target_id] || "?"}`),
        h("td", { "data-test": "lag" }, lagCell(p)),
        h("td", {}, p ? fmt.bytes(p.lag_bytes) : "…"),
        h("td", { class: "mono" }, (p && p.applied_lsn) || s.applied_lsn || "—"),
        h("td", {}, p && p.consumer.alive ? badge("running", "ok") : badge("stopped", "idle")));
    }));
    if (!subs.length) {
      tbody.append(h("tr", {}, h("td", { colspan: 7, class: "muted" },
        "No subscriptions yet: create one below.")));
    }
  }, 5000);
}

function createForm(sources, targets) {
  const pubs = h("div", { class: "checks", "data-test": "sub-publications" });
  const sourceSelect = h("select", { name: "source_id", required: true },
    sources.map((s) => h("option", { value: s.id }, s.name)));
  const loadPublications = async () => {
    fill(pubs, h("span", { class: "muted" }, "loading…"));
    try {
      const list = await get(`/sources/${sourceSelect.value}/publications`);
      fill(pubs, ...list.map((p) => h("label", { class: "check" },
        h("input", { type: "checkbox", name: "publications", value: p.name }), p.name)));
      if (!list.length) fill(pubs, h("span", { class: "muted" },
        "this source has no publications yet"));
    } catch (err) {
      fill(pubs, errorBox(err));
    }
  };
  sourceSelect.addEventListener("change", loadPublications);
  if (sources.length) loadPublications();

  const form = h("form", { class: "card form", "data-test": "create-subscription" },
    h("h3", {}, "New subscription"),
    field("Name", h("input", { name: "name", required: true, pattern: "[A-Za-z0-9_][A-Za-z0-9_.\\-]*",
      maxlength: 63 })),
    field("Source", sourceSelect),
    field("Publications", pubs),
    field("Target", h("select", { name: "target_id", required: true },
      targets.map((t) => h("option", { value: t.id }, t.name)))),
    h("label", { class: "check" }, h("input", { type: "checkbox", name: "copy_data",
      checked: true }), "copy existing rows first (initial sync)"),
    h("label", { class: "check" }, h("input", { type: "checkbox", name: "enabled",
      checked: true }), "start streaming"),
    h("button", { type: "submit" }, "Create subscription"));
  return submitting(form, async (data) => {
    const created = await post("/subscriptions", {
      name: data.get("name").trim(),
      source_id: data.get("source_id"),
      target_id: data.get("target_id"),
      publications: data.getAll("publications"),
      copy_data: data.get("copy_data") === "on",
      enabled: data.get("enabled") === "on",
    });
    location.hash = `#/subscriptions/${created.id}`;
  });
}

// -- one subscription --------------------------------------------------------------------

export async function subscriptionDetail(root, ctx, id) {
  const sub = await get(`/subscriptions/${id}`);
  const [source, target] = await Promise.all([
    get(`/sources/${sub.source_id}`).catch(() => null),
    get(`/targets/${sub.target_id}`).catch(() => null)]);

  const stateBadge = h("span", { "data-test": "sub-state" });
  const actions = h("div", { class: "actions" });
  const message = h("div");
  const alerts = h("div");
  const numbers = {
    lag: h("div", { class: "big", "data-test": "lag-seconds" }, "…"),
    bytes: h("div", { class: "big", "data-test": "lag-bytes" }, "…"),
    consumer: h("div", { class: "big", "data-test": "consumer" }, "…"),
    commit: h("div", { class: "big small-big", "data-test": "last-commit" }, "…"),
  };
  const lsns = h("div", { class: "lsns", "data-test": "lsns" });
  const chart = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  chart.setAttribute("class", "chart");
  chart.setAttribute("data-test", "lag-chart");
  const tablesBody = h("tbody");
  const jobs = h("div", { "data-test": "jobs" });
  const jobList = h("div", { "data-test": "job-list" });
  const schemaBody = h("tbody");
  let metric = "lag_seconds";
  const metricButtons = h("div", { class: "toggle" },
    [["lag_seconds", "seconds"], ["lag_bytes", "bytes"]].map(([key, label]) =>
      h("button", { type: "button", class: key === metric ? "on" : null, onclick: (e) => {
        metric = key;
        metricButtons.querySelectorAll("button").forEach((b) => b.classList.remove("on"));
        e.target.classList.add("on");
        drawChart();
      } }, label)));

  root.append(
    h("section", { class: "card" },
      h("div", { class: "title-row" },
        h("h2", {}, h("a", { href: "#/subscriptions" }, "Subscriptions"), " / ", sub.name),
        stateBadge, actions),
      h("p", { class: "muted" },
        `${source ? source.name : sub.source_id} → ${target ? target.name : sub.target_id} · `,
        `slot `, h("code", {}, sub.slot_name), " · publications ",
        sub.publications.map((p, i) => [i ? ", " : "", h("code", {}, p)])),
      schemaPolicy(sub.options),
      message,
      alerts,
      h("div", { class: "stats" },
        h("div", { class: "stat" }, h("span", {}, "Lag"), numbers.lag),
        h("div", { class: "stat" }, h("span", {}, "Behind (WAL)"), numbers.bytes),
        h("div", { class: "stat" }, h("span", {}, "Consumer"), numbers.consumer),
        h("div", { class: "stat" }, h("span", {}, "Last applied commit"), numbers.commit)),
      lsns),
    subscriptionAlerts(ctx, id),
    h("section", { class: "card" },
      h("div", { class: "title-row" }, h("h3", {}, "Lag, last 15 minutes"), metricButtons),
      chart),
    h("section", { class: "card" },
      h("h3", {}, "Tables"),
      h("table", { class: "grid-table", "data-test": "tables" },
        h("thead", {}, h("tr", {}, ["Table", "Sync", "Initial copy", "Inserts", "Updates",
          "Deletes", "Truncates", "Conflicts", "Missing rows skipped", ""].map((c) =>
            h("th", {}, c)))),
        tablesBody),
      jobs,
      h("h3", {}, "Sync jobs"),
      jobList),
    h("section", { class: "card" },
      h("h3", {}, "Schema changes"),
      h("table", { class: "grid-table", "data-test": "schema-changes" },
        h("thead", {}, h("tr", {}, ["Time", "Table", "Change", "Before → after", "Action",
          "Code"].map((c) => h("th", {}, c)))),
        schemaBody)));

  let progress = null;
  let history = [];
  const live = [];

  function drawChart() {
    const points = [...history, ...live]
      .map((p) => [Date.parse(p.at), p[metric]])
      .sort((a, b) => a[0] - b[0]);
    lineChart(chart, [{ label: metric, color: "#2f6fdf", points }],
      { format: metric === "lag_bytes" ? fmt.bytes : fmt.seconds });
  }

  function renderActions(p) {
    const button = (label, path, test) => h("button", { type: "button", "data-test": test,
      onclick: async (e) => {
        e.target.disabled = true;
        try {
          await post(`/subscriptions/${id}/${path}`);
          fill(message);
          await refresh();
        } catch (err) {
          fill(message, errorBox(err));
        } finally {
          e.target.disabled = false;
        }
      } }, label);
    fill(actions,
      p.enabled ? button("Disable", "disable", "disable") : button("Enable", "enable", "enable"),
      h("button", { type: "button", "data-test": "refresh-publications",
        title: "pick up tables added to (or dropped from) the publications",
        onclick: refreshPublications }, "Refresh publications"),
      h("button", { type: "button", class: "danger", onclick: async () => {
        if (!confirm(`Delete subscription ${sub.name}? Its replication slot is dropped too.`)) return;
        try {
          await del(`/subscriptions/${id}`);
          location.hash = "#/subscriptions";
        } catch (err) {
          fill(message, errorBox(err));
        }
      } }, "Delete"));
  }

  function renderLsns(p) {
    const base = lsnValue(p.consistent_lsn) ?? lsnValue(p.applied_lsn);
    const top = lsnValue(p.source_lsn);
    const applied = lsnValue(p.applied_lsn) ?? base;
    const received = lsnValue(p.received_lsn);
    const share = (v) => (top && base != null && v != null && top > base
      ? Math.max(0, Math.min(100, Number(((v - base) * 10000n) / (top - base)) / 100)) : 0);
    fill(lsns,
      h("div", { class: "lsn-bar", title: "applied / received, relative to the source" },
        h("div", { class: "lsn-received", style: `width: ${share(received)}%` }),
        h("div", { class: "lsn-applied", style: `width: ${p.lag_bytes === 0 ? 100 : share(applied)}%` })),
      h("dl", { class: "lsn-list" },
        h("dt", {}, "source"), h("dd", { class: "mono", "data-test": "source-lsn" },
          p.source_lsn || (p.source_reachable ? "—" : "unreachable")),
        h("dt", {}, "received"), h("dd", { class: "mono" }, p.received_lsn || "—"),
        h("dt", {}, "applied"), h("dd", { class: "mono", "data-test": "applied-lsn" },
          p.applied_lsn || "—")));
  }

  function renderTables(p) {
    fill(tablesBody, ...p.tables.map((t) => h("tr", { "data-test": `table-${t.table}` },
      h("td", { class: "mono" }, t.table),
      h("td", {}, badge(t.sync_state)),
      h("td", {}, t.rows_total != null || t.rows_copied
        ? progressBar(t.rows_copied, t.rows_total,
          `${fmt.count(t.rows_copied)} / ${t.rows_total == null ? "?" : fmt.count(t.rows_total)}`)
        : h("span", { class: "muted" }, "—")),
      ...["inserts", "updates", "deletes", "truncates", "conflicts"].map((k) =>
        h("td", { class: "num" }, fmt.count(t[k]))),
      h("td", { class: "num", "data-test": "missing-skipped",
        title: t.last_missing
          ? `last: ${t.last_missing.op} of ${JSON.stringify(t.last_missing.key)} ` +
            `(commit ${t.last_missing.lsn}); skipped as PostgreSQL's subscriber does`
          : "UPDATEs/DELETEs whose target row was missing (skipped, as PostgreSQL does)" },
        fmt.count(t.missing_skipped || 0),
        t.last_missing ? h("div", { class: "muted mono small", "data-test": "last-missing" },
          `${t.last_missing.op} ${JSON.stringify(t.last_missing.key)} @ ${t.last_missing.lsn}`)
          : null),
      h("td", {}, h("button", { type: "button", class: "small", "data-test": "resync",
        title: "copy the table again (emptied, then loaded)",
        onclick: () => resync(t.table) }, "Resync"),
      h("button", { type: "button", class: "small", "data-test": "resync-diff",
        title: "compare with the source and write only the differences (the table is never emptied)",
        onclick: () => resync(t.table, "diff") }, "Diff")))));
    if (!p.tables.length) {
      tablesBody.append(h("tr", {}, h("td", { colspan: 10, class: "muted" }, "no tables")));
    }
  }

  async function refreshPublications() {
    try {
      const out = await post(`/subscriptions/${id}/refresh`, { copy_data: true });
      const said = [];
      if (out.added.length) said.push(`added ${out.added.join(", ")}`);
      if (out.removed.length) said.push(`removed ${out.removed.join(", ")}`);
      fill(message, h("div", { class: "muted", "data-test": "refresh-result" },
        said.length ? said.join("; ") : "the publications publish no new tables"));
      if (out.job_id) watchJob(out.job_id, out.added.join(", "));
      await refresh();
    } catch (err) {
      fill(message, errorBox(err));
    }
  }

  async function resync(table, mode = "copy") {
    const question = mode === "diff"
      ? `Compare ${table} with the source and write only the differences?`
      : `Copy ${table} again from the source (the target's rows are replaced)?`;
    if (!confirm(question)) return;
    try {
      const job = await post(`/subscriptions/${id}/sync`, { tables: [table], mode });
      watchJob(job.job_id, table);
    } catch (err) {
      jobs.prepend(errorBox(err));
    }
  }

  function watchJob(jobId, label) {
    const row = h("div", { class: "job", "data-test": `job-${jobId}` }, `resync ${label}: queued`);
    jobs.prepend(row);
    const timer = setInterval(async () => {
      if (!ctx.active) { clearInterval(timer); return; }
      try {
        const job = await get(`/jobs/${jobId}`);
        const { done = 0, total = null } = job.progress || {};
        fill(row, h("span", {}, `${job.kind} ${label}: `, badge(job.state)),
          progressBar(done, total, `${fmt.count(done)} / ${total == null ? "?" : fmt.count(total)}`),
          waitingFor(job),
          job.error ? h("div", { class: "error" }, job.error) : null);
        if (TERMINAL_JOB_STATES.has(job.state)) clearInterval(timer);
      } catch (err) {
        fill(row, errorBox(err));
        clearInterval(timer);
      }
    }, 1000);
    ctx.timers.push(timer);
  }

  // A slot being created waits for the source's running transactions (any database,
  // prepared ones too): the job names them (GET /jobs/{id} waiting_for).
  function waitingFor(job) {
    const w = job.waiting_for;
    if (!w) return null;
    const oldest = w.transactions[0];
    const who = !oldest ? "none this role can see (pg_read_all_stats shows them)"
      : oldest.prepared_gid != null
        ? `prepared transaction '${oldest.prepared_gid}' in ${oldest.database}`
        : `pid ${oldest.pid} in ${oldest.database} (${oldest.state}`
          + `${oldest.application_name ? `, ${oldest.application_name}` : ""})`;
    const since = oldest && oldest.started_at ? `, began ${fmt.ago(oldest.started_at)}` : "";
    return h("div", { class: "warning", "data-test": "waiting-for" },
      `slot ${w.slot} waits ${fmt.seconds(w.seconds)} for ${w.transactions.length} `
      + `transaction(s) on the source to end; oldest: ${who}${since}`);
  }

  function jobLine(job) {
    const { done = 0, total = null } = job.progress || {};
    const moved = job.scope === "moved_rows";
    const what = moved ? "reconciliation by the rows the filter change moves"
      : job.reason === "reconcile" ? "reconciliation (filter change)"
      : job.mode === "diff" ? "diff resync" : job.kind.replace("_", " ");
    const d = job.diff;
    const waiting = moved && !d
      ? (job.phase === "waiting_for_stream"
        ? `${fmt.count(done)} rows staged, merged when the stream reaches the change…`
        : "reading the rows that move…")
      : "comparing…";
    return h("div", { class: "job", "data-test": `sync-job-${job.id}` },
      h("span", {}, `${what} of ${job.tables.map((t) => t.table).join(", ")}: `),
      badge(job.state),
      job.mode === "diff"
        ? h("span", { "data-test": "diff-counts" }, d
          ? `${fmt.count(d.compared)} rows compared · ${fmt.count(d.added)} added · `
            + `${fmt.count(d.removed)} removed · ${fmt.count(d.updated)} updated`
          : waiting)
        : progressBar(done, total, `${fmt.count(done)} / ${total == null ? "?" : fmt.count(total)}`),
      h("span", { class: "muted" }, fmt.time(job.created_at)),
      waitingFor(job),
      job.error ? h("div", { class: "error" }, job.error) : null);
  }

  async function loadJobs() {
    const list = await get(`/jobs?subscription_id=${encodeURIComponent(id)}`, { signal: ctx.signal });
    if (!ctx.active) return;
    const recent = list.slice(0, 5);
    fill(jobList, ...recent.map(jobLine));
    if (!recent.length) jobList.append(h("p", { class: "muted" }, "no sync jobs yet"));
  }

  async function refresh() {
    const p = await get(`/subscriptions/${id}/progress`, { signal: ctx.signal });
    if (!ctx.active) return;
    progress = p;
    fill(stateBadge, badge(p.state), p.enabled ? "" : badge("disabled", "idle"));
    renderActions(p);
    const problems = [];
    if (p.error) problems.push(h("div", { class: "error", "data-test": "sub-error" }, p.error));
    if (!p.source_reachable) {
      problems.push(h("div", { class: "warning" }, `source unreachable: ${p.source_error}`));
    }
    fill(alerts, ...problems);
    numbers.lag.textContent = p.lag_seconds == null ? "unknown" : fmt.seconds(p.lag_seconds);
    numbers.lag.dataset.value = p.lag_seconds == null ? "" : String(p.lag_seconds);
    numbers.lag.className = `big ${p.lag_seconds === 0 ? "good" : p.lag_seconds > 60 ? "bad" : ""}`;
    numbers.bytes.textContent = fmt.bytes(p.lag_bytes);
    numbers.bytes.dataset.value = p.lag_bytes == null ? "" : String(p.lag_bytes);
    const w = p.consumer.worker;
    const ms = (s) => `${Math.round(s * 1000)} ms`;
    fill(numbers.consumer, p.consumer.alive
      ? badge("running", "ok") : badge("stopped", "idle"),
      h("small", {}, p.consumer.heartbeat_at ? ` heartbeat ${fmt.ago(p.consumer.heartbeat_at)}` : ""),
      w ? h("small", { class: "muted", "data-test": "scheduler",
        title: "the worker holding this subscription: how many it holds, and how long a "
          + "subscription that is due waits for its turn there (last minute)" },
        h("br"), `on ${w.worker} · ${w.subscriptions_held} subscription${w.subscriptions_held === 1 ? "" : "s"}`
          + ` held · turn wait `
          + `p50 ${ms(w.turn_wait_p50_seconds)}, p99 ${ms(w.turn_wait_p99_seconds)}`) : "");
    numbers.commit.textContent = p.last_commit_ts ? fmt.time(p.last_commit_ts) : "—";
    renderLsns(p);
    renderTables(p);
    live.push({ at: p.observed_at, lag_seconds: p.lag_seconds, lag_bytes: p.lag_bytes });
    if (live.length > 900) live.shift();
    drawChart();
  }

  async function loadHistory() {
    const since = new Date(Date.now() - 15 * 60 * 1000).toISOString();
    const body = await get(`/subscriptions/${id}/progress/history?since=${encodeURIComponent(since)}`,
      { signal: ctx.signal });
    if (!ctx.active) return;
    history = body.samples.map((s) => ({ at: s.sampled_at, lag_seconds: s.lag_seconds,
      lag_bytes: s.lag_bytes }));
    const newest = history.length ? Date.parse(history[history.length - 1].at) : 0;
    // live points older than the newest sample are covered by the history now
    while (live.length && Date.parse(live[0].at) <= newest) live.shift();
    drawChart();
  }

  async function loadSchemaChanges() {
    const list = await get(`/subscriptions/${id}/schema-changes?limit=10`, { signal: ctx.signal });
    if (!ctx.active) return;
    fill(schemaBody, ...list.map(schemaChangeRow));
    if (!list.length) {
      schemaBody.append(h("tr", {}, h("td", { colspan: 6, class: "muted" },
        "no schema changes met yet")));
    }
  }

  ctx.poll(refresh, 2000);
  ctx.poll(loadJobs, 2000);
  ctx.poll(loadSchemaChanges, 5000);
  ctx.poll(loadHistory, 10000);
  return progress;
}

/** What the stream does with a source DDL (GET /subscriptions/{id} options): follow or
 *  stop, and whether a column dropped at the source is dropped at the target too. */
function schemaPolicy(options) {
  const policy = options.schema_changes || "stop";
  return h("p", { class: "muted", "data-test": "schema-policy",
    title: "follow: safe source DDL is run at the target in the batch's transaction; "
      + "stop: the table stops with the DDL to run at the target" },
  "schema changes: ", h("code", {}, policy), " · dropped columns: ",
  options.drop_columns ? "dropped at the target" : "kept at the target");
}

const columnText = (c) => {
  if (!c) return "—";
  if (c.table) {  // add_table: the table created at the target
    const cols = (c.columns || []).map((col) => `${col.column} ${col.type}`).join(", ");
    return `table ${c.table}${cols ? ` (${cols})` : ""}`;
  }
  return `${c.column} ${c.type}`;
};

/** One source DDL met by the stream: when, where, before → after, what was done; the
 *  DDL (run at the target, or to run there) as the row's tooltip. */
function schemaChangeRow(c) {
  const kind = c.action === "stopped" ? "error" : "ok";
  return h("tr", { "data-test": `schema-change-${c.table}-${c.change}`,
    title: c.ddl.length ? c.ddl.join(";\n") : null },
  h("td", {}, fmt.time(c.at)),
  h("td", { class: "mono" }, c.table),
  h("td", {}, c.change.replace("_", " ")),
  h("td", { class: "mono" }, `${columnText(c.before)} → ${columnText(c.after)}`),
  h("td", {}, badge(c.action, kind)),
  h("td", { class: "mono" }, c.code || ""));
}

/** fn over items, at most `width` at once; the results in the items' order. */
async function inTurns(items, width, fn) {
  const out = new Array(items.length);
  let next = 0;
  const lane = async () => {
    while (next < items.length) {
      const i = next++;
      out[i] = await fn(items[i]);
    }
  };
  await Promise.all(Array.from({ length: Math.min(width, items.length) }, lane));
  return out;
}
