"""Chat formats: one object per model family owns rendering, parsing, forcing tool calls and stop tokens."""

from artrl.local.chat_format.chat_format import ChatFormat, TemplateRenderError
from artrl.local.chat_format.families import FAMILIES, Family, detect_family, family_named
from artrl.local.chat_format.output import OutputParser, Piece, ToolCall

__all__ = [
    "FAMILIES",
    "ChatFormat",
    "Family",
    "OutputParser",
    "Piece",
    "TemplateRenderError",
    "ToolCall",
    "detect_family",
    "family_named",
]
