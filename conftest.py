# Fixtures shared by tests/ and harness/ (a real mesh on a free port, clients, spans; two meshes on an IOA network).
pytest_plugins = ["tests.fixtures", "tests.ioa_nodes"]
