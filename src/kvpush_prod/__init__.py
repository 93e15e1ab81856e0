"""kvpush-prod: a hardened push-based KV-cache transfer connector for vLLM P/D disaggregation.

Load it through vLLM's ``kv_transfer_config`` with ``kv_connector_module_path: kvpush_prod.connector``.
"""

__version__ = "0.2.0"
