"""Tool-call formats by ``--tool-call-parser`` name (SGLang's names, vLLM's as aliases).

=================  ==========================================  ===========================
name               format                                      module
=================  ==========================================  ===========================
``qwen25``         JSON in ``<tool_call>`` tags (Qwen 2.5)     :mod:`.qwen25`
``qwen``           the same (vLLM name)
``hermes``         the same (vLLM name)
``deepseekv3``     DeepSeek-V3 markers + fenced JSON           :mod:`.deepseekv3`
``deepseek_v3``    the same (vLLM name)
``llama3``         Llama 3 JSON (``<|python_tag|>``)           :mod:`.llama3`
``llama3_json``    the same (vLLM name)
=================  ==========================================  ===========================
"""

from __future__ import annotations

from fleetserve.entrypoints.tool_parsers.base import Scan, ToolCallStream, ToolFormat, parse_tool_calls
from fleetserve.entrypoints.tool_parsers.deepseekv3 import DeepSeekV3Format
from fleetserve.entrypoints.tool_parsers.llama3 import Llama3Format
from fleetserve.entrypoints.tool_parsers.qwen25 import Qwen25Format

_FORMATS = {"qwen25": Qwen25Format, "qwen": Qwen25Format, "hermes": Qwen25Format,
            "deepseekv3": DeepSeekV3Format, "deepseek_v3": DeepSeekV3Format,
            "llama3": Llama3Format, "llama3_json": Llama3Format}
TOOL_CALL_PARSERS = tuple(_FORMATS)


def get_format(name: str | None) -> ToolFormat:
    """The format ``name`` (None: ``qwen25``, the format forced calls use without a parser).

    Raises KeyError for an unknown name (``--tool-call-parser`` is checked at start-up).
    """
    return _FORMATS[name or "qwen25"]()


__all__ = ["Scan", "ToolCallStream", "ToolFormat", "TOOL_CALL_PARSERS", "get_format", "parse_tool_calls"]
