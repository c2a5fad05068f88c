"""The score of an instruction task's held-out examples (`adept-ext continual`'s matrix; docs/continual.md,
"Scores"): exact match of the greedy answer, and the answers' loss."""
from typing import Dict

import torch

from ..data.blocks import batches


@torch.no_grad()
def answer_scores(model, blocks: Dict[str, torch.Tensor], batch_size: int, device, eos_id=None) -> Dict[str, float]:
    """Exact-match accuracy of the greedy answer and the token-weighted loss of the labelled tokens
    over instruction blocks. An example is right when the argmax prediction equals the label at every
    labelled position (the EOS target `eos_id` excepted): in one teacher-forced forward, the same as
    greedy decoding from the prompt reproducing the answer token for token. With `eos_id` None
    (a conversational task) every labelled token counts, the end-of-turn marker included: the greedy
    reply, generated through the template's generation prompt, must stop where the reference does
    (docs/continual.md, "Scores")."""
    was_training = model.training
    model.eval()
    correct, total_loss, tokens = 0, 0.0, 0
    try:
        for batch in batches(blocks, batch_size):
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
            targets = batch["labels"][:, 1:]
            logits = logits[:, :-1].float()
            scored = targets != -100
            loss = torch.nn.functional.cross_entropy(logits[scored], targets[scored], reduction="sum")
            total_loss += float(loss)
            tokens += int(scored.sum())
            answer = scored & (targets != eos_id) if eos_id is not None else scored
            hit = (logits.argmax(-1) == targets) | ~answer
            correct += int(hit.all(dim=1).sum())
    finally:
        model.train(was_training)
    return {"accuracy": correct / blocks["input_ids"].shape[0], "answer_loss": total_loss / tokens}
