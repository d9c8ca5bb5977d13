"""Vision-language pieces (Qwen2.5-VL): image decoding, the image processor, the vision tower and
multimodal rotary positions, each a plain function over tensors and weight dicts like `engine.models`.

The entry points for the engine are re-exported here. Loading: `engine.loading.hf_vision.load_hf_vl`.
At generation: `prepare_vision_prompt` (images + messages -> ids, M-RoPE positions and delta, image
embeddings, the rows they replace), or the pieces: `load_image`, `preprocess_images`, `encode_images`,
`build_prompt_ids`, `mrope_positions`; `mrope_cos_sin` / `MRotaryTable` for the rotary tables and
`decode_positions` for generated tokens.

The engine runs the tower through `vision_pass.VisionPass` (weights in host memory streamed to the GPU
through booked slots, activations booked and bounded by a work cap, the pass planned and priced by
`vision_pass.plan_vision_pass` against the VRAM budget, or run on the CPU where that is cheaper).
"""

from engine.models.vision.image_input import load_image
from engine.models.vision.mrope import (
    MRotaryTable,
    build_prompt_ids,
    decode_positions,
    mrope_cos_sin,
    mrope_positions,
)
from engine.models.vision.pipeline import VisionPrompt, prepare_vision_prompt
from engine.models.vision.qwen2_5_vl_processor import ImageProcessorConfig, preprocess_images
from engine.models.vision.qwen2_5_vl_tower import VisionConfig, encode_images

__all__ = ["ImageProcessorConfig", "MRotaryTable", "VisionConfig", "VisionPrompt", "build_prompt_ids",
           "decode_positions", "encode_images", "load_image", "mrope_cos_sin", "mrope_positions",
           "prepare_vision_prompt", "preprocess_images"]
