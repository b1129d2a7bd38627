"""The vLLM engine: supervised vLLM servers, token-in/token-out completions, replicas and their router."""
