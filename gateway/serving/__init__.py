"""The tenant-facing OpenAI API: a request from its bytes to its answer."""
