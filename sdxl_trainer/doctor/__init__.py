"""Find and repair damaged LoRA/DoRA adapter weights: the logic of debug_dora_weights.py and
fix_dora_weights.py.

DoRA weights trained in fp16 can go NaN/Inf, and every image then comes out black (docs/design.md,
"Black images from DoRA trained in fp16"). Files from elsewhere bring more damage: zero-norm rows
(DoRA divides by the row norm: 0/0, peft#2049), a 1-D `dora_scale` (ComfyUI rejects it), peft key
names left in kohya files.

DoRA in one line (docs/formats.md, "DoRA"): W' = m · V/‖V‖ with V = W + ΔW and
ΔW = (alpha/r)·up@down, the norm taken per output row (peft, LyCORIS >= 3.2) or per input column
(older LyCORIS); m is peft's magnitude or kohya's `dora_scale`. LoRA is W' = W + ΔW.

Modules, in the order a file goes through them:

- `base_weights`: the base model's weights, which the norm checks and most DoRA repairs need;
- `checks`: the thresholds and what counts as damage, module by module;
- `report`: a file's modules analysed into a report (what debug_dora_weights.py prints);
- `repairs`: what to do with one damaged module;
- `rewrite`: the plan for a whole file, and writing and verifying the repaired copy;
- `cli`: what the two scripts share (options, exit codes, error handling).
"""
