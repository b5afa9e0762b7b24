"""The mesh's web view (docs/webview.md): the live agent tree with each inbox's depth, and a sequence diagram
of messages between agents as they happen, served by the mesh process on an HTTP port of its own and fed by
the event record's live watch (in process: no gRPC, no polling of agents). `app` is the HTTP server, `board`
the fold of the record it keeps, `static/` the page (plain HTML, CSS and JavaScript; no build step)."""

from services.webview.app import WebView

__all__ = ["WebView"]
