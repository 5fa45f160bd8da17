"""``ascend-store bench``: named workloads against any OpenAI-compatible server.

``workloads`` builds the requests, ``client`` sends them one at a time (streaming, so the
first streamed chunk gives the TTFT) and reads the pool's share of each prompt from the
server's Prometheus counter, ``report`` prints the table and writes JSON and PNG plots.
"""

from ascend_store.ops.bench.client import BenchError, Sample, Server, run
from ascend_store.ops.bench.workloads import WORKLOADS, Request, Workload

__all__ = ["BenchError", "Request", "Sample", "Server", "WORKLOADS", "Workload", "run"]
