// DOM building without innerHTML (every value from the API is text, never markup),
// formatting, and small helpers shared by the views.

/**
 * h("div", {class: "x", onclick: fn, "data-test": "y"}, child, [children], "text")
 * Attribute values of null/undefined/false are left out; children may be nested arrays.
 */
export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value == null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      node.addEventListener(key.slice(2), value);
    } else if (key === "style") {
      // CSSOM, not a style attribute: the Content-Security-Policy forbids inline styles
      node.style.cssText = String(value);
    } else if (key === "value") {
      node.value = value;
    } else if (key === "checked" || key === "disabled" || key === "selected") {
      node[key] = Boolean(value);
    } else {
      node.setAttribute(key, value === true ? "" : String(value));
    }
  }
  append(node, children);
  return node;
}

/** Replace a node's children (skipping null/false, flattening arrays, as h() does). */
export function fill(node, ...children) {
  node.replaceChildren();
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children) {
    if (child == null || child === false) continue;
    if (Array.isArray(child)) append(node, child);
    else node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function badge(text, kind = text) {
  return h("span", { class: `badge badge-${kind}` }, text);
}

export function errorText(err) {
  if (err && typeof err.describe === "function") return err.describe();
  return String((err && err.message) || err);
}

export function errorBox(err) {
  return h("div", { class: "error", role: "alert" }, errorText(err));
}

export function debounce(fn, ms) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}

export const fmt = {
  bytes(n) {
    if (n == null) return "—";
    const units = ["B", "kB", "MB", "GB", "TB"];
    let value = Number(n);
    let i = 0;
    while (Math.abs(value) >= 1024 && i < units.length - 1) { value /= 1024; i++; }
    return `${i ? value.toFixed(1) : value} ${units[i]}`;
  },
  seconds(s) {
    if (s == null) return "—";
    if (s < 60) return `${Number(s).toFixed(s < 10 ? 1 : 0)} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
    return `${(s / 86400).toFixed(1)} days`;
  },
  count(n) {
    return n == null ? "—" : Number(n).toLocaleString("en");
  },
  time(iso) {
    return iso ? new Date(iso).toLocaleString() : "—";
  },
  ago(iso) {
    if (!iso) return "never";
    return `${fmt.seconds(Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000))} ago`;
  },
};

/** LSN text "X/Y" -> BigInt byte position (null for null). */
export function lsnValue(text) {
  if (!text) return null;
  const [hi, lo] = text.split("/");
  return (BigInt(`0x${hi}`) << 32n) + BigInt(`0x${lo}`);
}

export function progressBar(done, total, label) {
  const pct = total ? Math.min(100, (100 * done) / total) : (done ? 100 : 0);
  return h("div", { class: "bar", title: label || `${pct.toFixed(0)}%` },
    h("div", { class: "bar-fill", style: `width: ${pct.toFixed(1)}%` }),
    h("span", { class: "bar-text" }, label || `${pct.toFixed(0)}%`));
}

export function field(label, input, hint) {
  return h("label", { class: "field" }, h("span", { class: "field-label" }, label), input,
    hint ? h("small", { class: "hint" }, hint) : null);
}

/** A form's submit handler that shows the API's error inline and disables the button
 *  while the request runs. */
export function submitting(form, action) {
  const status = h("div", { class: "form-status" });
  form.append(status);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const button = form.querySelector("button[type=submit]");
    status.replaceChildren();
    if (button) button.disabled = true;
    try {
      await action(new FormData(form));
    } catch (err) {
      status.replaceChildren(errorBox(err));
    } finally {
      if (button) button.disabled = false;
    }
  });
  return form;
}
