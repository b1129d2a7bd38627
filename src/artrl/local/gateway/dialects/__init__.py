"""The request shapes the gateway answers, each served by the chat-completions path it amounts to.

A dialect (plain chat completions, the Responses API, Anthropic Messages) translates its request into a
chat-completions request, and the chat completion (or the serving layer's stream of events) back into its
own response. Everything between — rendering, continuation of earlier calls, generation, captures, training
records — is the chat path's (calls.py), so a call in any dialect is recorded token-exactly, like a chat
completion.

dialect.py holds the `Dialect` protocol and what the dialects share; chat.py is plain chat completions,
responses.py (+ responses_items.py) OpenAI's Responses API, anthropic.py (+ anthropic_items.py) Anthropic's
Messages API.
"""

from artrl.local.gateway.dialects.anthropic import MessagesDialect
from artrl.local.gateway.dialects.chat import ChatDialect
from artrl.local.gateway.dialects.dialect import Dialect
from artrl.local.gateway.dialects.responses import ResponsesDialect

__all__ = ["ChatDialect", "Dialect", "MessagesDialect", "ResponsesDialect"]
