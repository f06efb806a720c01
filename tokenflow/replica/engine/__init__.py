"""The engine of one replica: `Engine` (scheduler + executor + input/output processing, one
`step()`), `run_steps` (the step loop, in `engine_loop`), the thread or process that runs it,
`AsyncEngine` (asyncio streams over it) and the offline `LLM`."""
