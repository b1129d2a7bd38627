"""Models and tokenizers: loading a hub id or a local folder, and the tiny models artrl builds offline."""
