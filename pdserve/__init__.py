"""pdserve: disaggregated prefill/decode serving for vLLM."""

__version__ = "0.1.0"
