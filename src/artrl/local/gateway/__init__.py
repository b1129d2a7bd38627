"""The OpenAI-compatible gateway: routes (app.py) → request checks (protocol.py) → serving (serving.py)."""
