// The public HTTP API, with the bearer token the person typed in (kept in sessionStorage:
// gone when the tab closes). Errors are RFC 9457 problem+json: thrown as ApiError.

const TOKEN_KEY = "pgsieve.token";

export function getToken() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(token) {
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
}

export class ApiError extends Error {
  constructor(status, problem) {
    const detail = problem && typeof problem === "object" ? problem.detail : String(problem || "");
    super(detail || `HTTP ${status}`);
    this.status = status;
    this.problem = problem && typeof problem === "object" ? problem : {};
    this.code = this.problem.code || `http_${status}`;
  }

  /** A one-line description for the person: "code: detail". */
  describe() {
    return `${this.code}: ${this.message}`;
  }
}

const listeners = new Set();
/** Called with no arguments when the API answers 401 (wrong or expired token). */
export function onUnauthorized(fn) {
  listeners.add(fn);
}

export async function api(method, path, body, { signal } = {}) {
  const headers = { Accept: "application/json" };
  const token = getToken();
  if (token) headers.Authorization = `Bearer ${token}`;
  const init = { method, headers, signal };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(`/api/v1${path}`, init);
  if (response.status === 204) return null;
  const type = response.headers.get("content-type") || "";
  const data = type.includes("json") ? await response.json() : await response.text();
  if (!response.ok) {
    if (response.status === 401) listeners.forEach((fn) => fn());
    throw new ApiError(response.status, data);
  }
  return data;
}

export const get = (path, opts) => api("GET", path, undefined, opts);
export const post = (path, body, opts) => api("POST", path, body === undefined ? {} : body, opts);
export const patch = (path, body, opts) => api("PATCH", path, body, opts);
export const del = (path) => api("DELETE", path);
