"""`distserve explain REQUEST_ID`: where a request's time went, and which stage broke which SLO.

Reads the request's trace from Jaeger's query API (as `distserve trace` does) or from an OTLP/JSON
export file (`spans`), cuts it into consecutive stretches before and after the first token
(`breakdown`), and says in words, with numbers, which stretch broke the TTFT or TPOT SLO (`report`).
"""

from distserve.explain.breakdown import Breakdown, Part, explain_rows
from distserve.explain.report import add_arguments, render, run
from distserve.explain.spans import TraceNotFound, rows_from_jaeger_reply, rows_from_otlp

__all__ = ["Breakdown", "Part", "TraceNotFound", "add_arguments", "explain_rows", "render", "rows_from_jaeger_reply",
           "rows_from_otlp", "run"]
