"""Plain types and error codes shared by the router and the agent. Imports nothing of ours."""
