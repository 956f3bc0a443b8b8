"""``/docs``: Swagger UI from the installed ``swagger-ui-py`` package, never a CDN.

The page has no inline script (its Content-Security-Policy allows scripts from this
origin only): the UI is started by ``/docs/init.js``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/assets"

_PAGE = f"""<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>pgsieve API</title>
  <link rel="stylesheet" href="{ASSETS}/swagger-ui.css">
  <link rel="icon" type="image/png" href="{ASSETS}/favicon-32x32.png">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="{ASSETS}/swagger-ui-bundle.js"></script>
  <script src="/docs/init.js"></script>
</body>
</html>
"""

_INIT = """window.ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout",
  persistAuthorization: false,
});
"""


def swagger_ui_static() -> Path:
    """The Swagger UI files of ``swagger-ui-py`` (found without importing the package,
    whose web-framework glue pgsieve does not use)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the swagger-ui-py package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "static"


def install_docs(app: FastAPI) -> None:
    app.mount(ASSETS, StaticFiles(directory=str(swagger_ui_static())), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return HTMLResponse(_PAGE)

    @app.get("/docs/init.js", include_in_schema=False)
    def docs_init() -> Response:
        return Response(_INIT, media_type="text/javascript")
