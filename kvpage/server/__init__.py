"""OpenAI-compatible server: `create_app(engine, ServerOptions(...))`."""

from kvpage.server.app import create_app
from kvpage.server.state import ServerOptions

__all__ = ["ServerOptions", "create_app"]
