// The dashboard: a login box, then views chosen by the URL fragment. Each view gets a
// context whose timers and requests stop when the person navigates away.

import { get, getToken, onUnauthorized, setToken } from "./api.js";
import { errorBox, h } from "./dom.js";
import { alertsView } from "./views/alerts.js";
import { auditView } from "./views/audit.js";
import { publicationsView } from "./views/publications.js";
import { sourcesView } from "./views/sources.js";
import { subscriptionDetail, subscriptionsView } from "./views/subscriptions.js";
import { targetsView } from "./views/targets.js";

const routes = [
  [/^#\/subscriptions\/([^/]+)$/, subscriptionDetail],
  [/^#\/subscriptions$/, subscriptionsView],
  [/^#\/sources$/, sourcesView],
  [/^#\/publications$/, publicationsView],
  [/^#\/targets$/, targetsView],
  [/^#\/alerts$/, alertsView],
  [/^#\/audit$/, auditView],
];
const NAV = [["#/subscriptions", "Subscriptions"], ["#/sources", "Sources & slots"],
  ["#/publications", "Publications"], ["#/targets", "Targets"], ["#/alerts", "Alerts"],
  ["#/audit", "Audit"]];

const main = document.getElementById("main");
const nav = document.getElementById("nav");
const noticeBox = document.getElementById("notice");

/** A line above the view saying what happened to the tab's session (null: none). */
function notice(text) {
  noticeBox.textContent = text || "";
  noticeBox.hidden = !text;
}
let current = null;

class ViewContext {
  constructor() {
    this.timers = [];
    this.controller = new AbortController();
  }
  get signal() {
    return this.controller.signal;
  }
  get active() {
    return !this.controller.signal.aborted;
  }
  /** Run fn now and then every ms (never overlapping itself) until the view is left. */
  poll(fn, ms) {
    let running = false;
    const tick = async () => {
      if (running || !this.active) return;
      running = true;
      try { await fn(); } catch (err) { console.warn(err); } finally { running = false; }
    };
    tick();
    this.timers.push(setInterval(tick, ms));
  }
  close() {
    this.timers.forEach(clearInterval);
    this.controller.abort();
  }
}

function renderNav(loggedIn) {
  nav.replaceChildren();
  if (!loggedIn) return;
  const here = location.hash.split("/").slice(0, 2).join("/");
  for (const [href, label] of NAV) {
    nav.append(h("a", { href, class: href === here ? "active" : null }, label));
  }
  nav.append(h("button", { type: "button", class: "link", "data-test": "logout",
    onclick: () => { setToken(null); notice(null); route(); } }, "Log out"));
}

function loginView() {
  const input = h("input", { type: "password", name: "token", autocomplete: "off",
    placeholder: "PGSIEVE_API_TOKEN", required: true, "data-test": "token" });
  const status = h("div");
  const form = h("form", { class: "card login", "data-test": "login" },
    h("h2", {}, "Log in"),
    h("p", {}, "The dashboard uses the API with the same bearer token ",
      h("code", {}, "make run"), " prints (kept for this browser tab only)."),
    input, h("button", { type: "submit" }, "Log in"), status);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    setToken(input.value.trim());
    try {
      await get("/sources");
      route(); // (an unknown or empty fragment is replaced by #/subscriptions, once)
    } catch (err) {
      setToken(null);
      status.replaceChildren(errorBox(err.status === 401 ? "that token is not accepted" : err));
    }
  });
  main.replaceChildren(form);
  input.focus();
}

// `make run` prints a URL with the token in the fragment (never sent to the server):
// take it, keep it for this tab, drop it from the address bar, and open `next` — only in
// a tab that is not signed in yet. A link can be anyone's: in a signed-in tab it must not
// swap the session for a token its author chose (the person would then work, and type
// DSNs, in the author's session); and where it is taken, the tab says so.
function takeTokenFromUrl() {
  const match = location.hash.match(/^#token=([^&]+)(?:&next=(\/[\w/-]*))?/);
  if (!match) return;
  history.replaceState(null, "", `${location.pathname}#${match[2] || "/subscriptions"}`);
  if (getToken()) {
    notice("This tab is signed in already: the token in the link you opened was ignored. " +
      "Log out first to use another token.");
    return;
  }
  setToken(decodeURIComponent(match[1]));
  notice("Signed in with the token from the link you opened. If you did not expect " +
    "that, log out.");
}

export function route() {
  takeTokenFromUrl();
  if (current) current.close();
  current = null;
  if (!getToken()) {
    renderNav(false);
    loginView();
    return;
  }
  if (!routes.some(([re]) => re.test(location.hash))) {
    location.replace("#/subscriptions");
    return; // hashchange routes again
  }
  renderNav(true);
  const ctx = new ViewContext();
  current = ctx;
  // Each view renders into its own container: a view still loading when the person
  // navigates away writes into a detached node, never into the next view.
  const container = h("div", { class: "view" });
  main.replaceChildren(container);
  for (const [re, view] of routes) {
    const match = location.hash.match(re);
    if (match) {
      view(container, ctx, ...match.slice(1).map(decodeURIComponent)).catch((err) => {
        if (ctx.active) container.replaceChildren(errorBox(err));
      });
      break;
    }
  }
}

onUnauthorized(() => {
  if (!current) return; // the login box reports a wrong token itself
  setToken(null);
  route();
});
window.addEventListener("hashchange", route);
route();
