"""Disaggregated serving: a context engine reads prompts and hands each request's state to a
generation engine, which continues it.

Selected by configuration only (``EngineConfig.role``: 'aggregated' by default, 'context' or
'generation'; ``peer``: how the other engine stores a request's state and whether it drafts;
``transfer_backend``: gloo on the CPU, NCCL on CUDA), and refused up front where the pair cannot run
(rules ``disaggregation_role_has_a_peer``, ``disaggregated_peers_store_state_alike``,
``disaggregated_draft_layers_agree``, ``transfer_backend_serves_the_device``).

- ``roles``: the transfer roles and the side-plane packing, as data that is the same on every
  tensor-parallel / attention-DP layout.
- ``handoff``: what a hand-off carries (exactly the request's state), ``extract`` on the context
  engine, ``adopt`` (checked first: ``TransferRejected``) on the generation engine.
- ``channel``: hand-offs over torch.distributed point-to-point messages.
- ``workers``: ``ContextWorker`` and ``GenerationWorker``, the loops of the two engines.
- ``pair``: a context and a generation worker in two processes (gloo on the CPU, NCCL on two CUDA
  devices), as the tests and bench/disagg.py run them.
"""
