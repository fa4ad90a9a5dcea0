"""What dtorch.stats() reports of a session: commands and batches sent, bytes, rejected
messages, and the counts that the frontend and dtorch.checkpoint keep here (redistributes
inserted, local tensors uploaded, checkpoint tensors and bytes).

A mixin of Controller (controller.py), which provides what these methods use: `_lock` (several
threads may issue ops), `sockets`, `workers`, `_reads`, `rejections`, and the counters it sets
to zero in __init__ (`commands_sent`, `redistributes_inserted`, ...).
"""
from __future__ import annotations

__all__ = ["SessionStats"]


class SessionStats:
    def count_inserted_redistribute(self) -> None:
        """One more redistribute the frontend inserted before an op (stats()); under the lock
        because several threads may issue ops."""
        with self._lock:
            self.redistributes_inserted += 1

    def count_local_upload(self) -> None:
        """One more torch tensor the frontend uploaded as an op's constant argument (stats())."""
        with self._lock:
            self.local_tensors_uploaded += 1

    def count_checkpoint(self, tensors: int, bytes_via_controller: int) -> None:
        """Tensors dtorch.checkpoint loaded, and the bytes it read here to upload (stats())."""
        with self._lock:
            self.checkpoint_tensors_loaded += tensors
            self.checkpoint_bytes_via_controller += bytes_via_controller

    def count_checkpoint_saved(self, tensors: int, nbytes: int) -> None:
        """Tensors dtorch.checkpoint.save wrote, and their bytes (the workers wrote them: the
        controller only sent SaveShard commands, so checkpoint_bytes_saved_via_controller is 0)."""
        with self._lock:
            self.checkpoint_tensors_saved += tensors
            self.checkpoint_bytes_saved += nbytes

    def stats(self) -> dict:
        s = self.sockets
        return {"commands_sent": self.commands_sent, "batches_sent": self.batches_sent,
                "messages_sent": s.messages_sent,
                "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received,
                "workers": len(self.workers), "pending_reads": len(self._reads), "reads_spun": self.reads_spun,
                "messages_rejected": self.rejections.count,
                "redistributes_inserted": self.redistributes_inserted,
                "local_tensors_uploaded": self.local_tensors_uploaded,
                "checkpoint_tensors_loaded": self.checkpoint_tensors_loaded,
                "checkpoint_bytes_via_controller": self.checkpoint_bytes_via_controller,
                "checkpoint_tensors_saved": self.checkpoint_tensors_saved,
                "checkpoint_bytes_saved": self.checkpoint_bytes_saved,
                "checkpoint_bytes_saved_via_controller": 0}   # save has no path through the controller
