"""The OpenAPI 3.1 document served at /openapi.json (gateway/openapi/document.py), its paths per
API family, and the building blocks they share."""
