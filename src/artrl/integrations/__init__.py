"""Other libraries' ways into artrl: a LangChain chat model, MCP servers' tools."""
