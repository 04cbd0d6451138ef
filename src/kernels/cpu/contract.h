// Gradient contract for every CPU kernel in this folder:
//   - forward functions overwrite their outputs and save what backward needs;
//   - backward functions ACCUMULATE (+=) into every gradient they write, parameter and
//     activation gradients alike, so residual branches and shared weights sum without copies;
//     the caller zeroes gradient buffers once per step.
// Argument order: outputs, then saved values, then inputs, then sizes.
// Reductions are split over threads by fixed ranges, so a given thread count is deterministic.
#pragma once
