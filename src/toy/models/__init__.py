"""Model definitions. Imports only torch and toy.models.* (see docs/architecture.md)."""
