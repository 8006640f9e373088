"""The HTTP face of ringwatch: thin FastAPI routers over the services."""
