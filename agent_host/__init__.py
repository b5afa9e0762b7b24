"""Agent hosts: processes that run agents against the mesh. For now, the
inbox stream that every host is built on."""
