"""What every route answers, as pydantic models: the schemas /openapi.json shows, and the contracts
tests/api/test_response_models.py holds real answers to. `answer` says how a route declares one."""
