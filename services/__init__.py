"""The mesh services: Registry, Inbox and Events over one store."""
