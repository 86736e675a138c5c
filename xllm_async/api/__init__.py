"""The OpenAI-compatible API: request validation, routes, response shapes."""
