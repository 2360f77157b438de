"""A mesh that places itself: members join a head (serve --join), the head plans the layers
(serve --mesh-members; head/planner.py decides), and a member without the model fetches only its
range's tensors, each checked before use.

- `manifest.py`: a range's file described tensor by tensor, served by the head, checked and cached
  by a member.
- `measure.py`: what a member reports of itself (its memory, one layer's time).
- `coordinator.py`: the head's side: admissions, the plan, heartbeats, deaths and restorations.
- `service.py`: `MeshService` over gRPC on the head.
- `member.py`: a joining node's side.
- `discovery.py`: the head announced and found by mDNS on a local network, where asked.
"""
