"""The `inboxmesh` command: the only package that imports both the mesh (`services`) and the agent host
(`agent_host`). `main` parses the command line, `run` is `inboxmesh run` (a host with agents), `demo` is
the two-agent exchange `inboxmesh up` runs."""
