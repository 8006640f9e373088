FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY agents agents
COPY services services
COPY api api
COPY migrations migrations
RUN pip install --no-cache-dir -e .
ENTRYPOINT []
