"""The HTTP process: the FastAPI app, its middleware (auth, limits, connection close while draining), start-up/shutdown order, the uvicorn shell."""
