"""Router: OpenAI-compatible HTTP and ``tandem.v1.Router`` front doors over the engine scheduler with remote drafter and verifier."""
