"""Serving on Ray Serve: the request path from HTTP to the engine replicas.

Modules, one noun each: `protocol` (OpenAI schemas), `errors` (OpenAI error JSON), `messages`
(what an LLMServer streams), `responses` (stream events -> OpenAI bodies and SSE), `prompts`
(tokenizing and chat templates), `ingress` (OpenAIIngress), `server` (LLMServer),
`replica_ingress` (the LLMServer as its own HTTP ingress, and HAProxy's ingress request
router), `serving_mode` (the Ray cluster switches of each serving mode), `pd` (disaggregated
prefill), `resume` (streams that outlive a replica), `prefix_router`, `autoscaling`, `metrics`
(tokenflow_* metrics) and `app` (build_app). Operations tooling lives in `tokenflow.ops`.
Nothing is imported here: the ingress must not pull in torch.
"""
