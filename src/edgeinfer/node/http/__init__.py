"""The node's HTTP side: the app and its routes, middleware, the uvicorn server and its connection guard,
and the response shapes (bodies and stream events) of both APIs."""
