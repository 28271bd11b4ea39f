"""`kvpage audit`: the verifier turned outward. A black-box audit of any OpenAI-compatible
server through its public API only — capabilities probed first, then baseline determinism, batch
invariance (and pressure), prefix reuse at block boundaries, canaries and cross-tenant timing —
with every divergence classed as noise, numeric drift or an isolation failure.

    from kvpage.audit import AuditConfig, run_audit
    result = run_audit(AuditConfig(base_url="http://127.0.0.1:8000", model="NAME"))
    result.exit_code  # 0 isolated, 1 a finding"""

from kvpage.audit.config import AuditConfig, Tolerances
from kvpage.audit.runner import AuditResult, run_audit

__all__ = ["AuditConfig", "AuditResult", "Tolerances", "run_audit"]
