"""The vLLM KV connector: ``kv_connector: PushConnector``, ``kv_connector_module_path: kvpush_prod.connector``.

A thin facade over the scheduler-side and worker-side halves.
"""

from kvpush_prod.connector.connector import PushConnector

__all__ = ["PushConnector"]
