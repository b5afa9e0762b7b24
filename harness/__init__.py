"""End-to-end scenarios against real mesh servers, asserting on recorded
evidence (the event record, message states, spans), never on what an agent
says. Run by the README's test command."""
