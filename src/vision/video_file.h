// Reading a video file through FFmpeg (video_file.cpp, built where FFmpeg's libraries are:
// MSA_WITH_FFMPEG). load_video (video_frames.cpp) chooses the frames and stores them.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "msa/vision_media.h"

namespace msa::vision::detail {

// What the container says about the video stream, and the frames counted in it.
struct VideoStreamInfo {
  int64_t frames = 0;  // video packets of the stream (one frame each for the codecs in use)
  double fps = 0;      // average frame rate (or frames / duration when the container has none)
  int64_t width = 0, height = 0;
};

// Opens `path`, counts its video stream's frames, asks `choose` which indices to keep
// (sorted, distinct, each < frames), then decodes the stream from the start and hands each
// chosen frame to `keep` as RGB8, in order. Should the decoder deliver fewer frames than
// were counted (a damaged file), the chosen indices past its end get its last frame.
// Errors name the file as `name`.
void read_video_file(const std::string& path, const std::string& name, const DecodeLimits& limits,
                     const std::function<std::vector<int64_t>(const VideoStreamInfo&)>& choose,
                     const std::function<void(int64_t index, Rgb8Image frame)>& keep);

}  // namespace msa::vision::detail
