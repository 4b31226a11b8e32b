"""The OpenAI-compatible protocol: request models, chat rendering, turning a request into engine calls and the engine's output into responses."""
