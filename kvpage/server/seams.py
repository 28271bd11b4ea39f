"""Declared seams of one server app: what a verifier's mutant may replace on its ServerState
(`app.state.server`), besides the public methods of the engine it owns. Each is a public
attribute whose contract is its type and docstring; a mutant names it here, so renaming or
removing one fails that mutant loudly instead of letting it pass as "missed"."""

from __future__ import annotations

SEAMS: dict[str, str] = {
    "text_stream": "each choice's TextStream factory: detokenizer (its `detok`, a Detokenizer: "
    "still_arriving), stop strings (stop_at, held_back) and text offsets (offset_of)",
    "tenants": "the Tenants object: API key -> tenant -> cache salt (cache_salt, salt_for)",
}
