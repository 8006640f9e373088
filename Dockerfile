FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY agents agents
COPY services services
COPY api api
COPY migrations migrations
RUN pip install --no-cache-dir -c constraints.txt -e .
ENTRYPOINT []
