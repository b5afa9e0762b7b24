"""The reference IOA network: a separate program (`inboxmesh ioa-server`), not part of the mesh. Meshes
reach it through their IOA relay (services/ioa/relay.py) over the network contract
(protos/inboxmesh/ioa/v1/network.proto); it shares no state with them."""
