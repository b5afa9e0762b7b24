# Fixtures shared by tests/ and harness/ (a real mesh on a free port, clients, spans).
pytest_plugins = ["tests.fixtures"]
