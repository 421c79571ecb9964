package app

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"bmeg.dev/testbed/internal/rpc"
)

// timelineLength is how many entries a timeline keeps in Redis (older ones are trimmed).
const timelineLength = 200

// maxRead is the most posts one timeline read returns.
const maxRead = 100

// TimelineWrite adds a post to timelines.
type TimelineWrite struct {
	UserID    int64   `json:"user_id"`
	PostID    int64   `json:"post_id"`
	Timestamp int64   `json:"timestamp"`
	Mentioned []int64 `json:"user_mentions_id,omitempty"`
}

// PostIDs lists posts to read.
type PostIDs struct {
	PostIDs []int64 `json:"post_ids"`
}

func postKey(id int64) string { return "post:" + strconv.FormatInt(id, 10) }

// post-storage-service: posts in a table; reads go through the in-process cache (cache_items),
// then memcached, then the table for what both lack (filling memcached and the cache).
var postStorage = Service{
	Name:     "post-storage-service",
	Memcache: true,
	Postgres: true,
	Cache:    true,
	Schema: []string{`CREATE TABLE IF NOT EXISTS posts (post_id BIGINT PRIMARY KEY, creator_id BIGINT NOT NULL,
		ts BIGINT NOT NULL, body JSONB NOT NULL)`},
	Register: func(e *Env, s *rpc.Server) {
		rpc.Handle(s, "store_post", func(ctx context.Context, p *Post) (*Empty, error) {
			body, _ := json.Marshal(p) // a Post always encodes
			_, err := e.Stores().Postgres.Exec(ctx, `INSERT INTO posts VALUES ($1, $2, $3, $4)`,
				p.PostID, p.Creator.UserID, p.Timestamp, body)
			if err != nil {
				return nil, fmt.Errorf("store post: %w", err)
			}
			return &Empty{}, nil
		})
		rpc.Handle(s, "read_posts", func(ctx context.Context, r *PostIDs) (*Posts, error) {
			if len(r.PostIDs) > maxRead {
				return nil, badRequest("read_posts reads at most %d posts, got %d", maxRead, len(r.PostIDs))
			}
			return e.readPosts(ctx, r.PostIDs)
		})
	},
}

func (e *Env) readPosts(ctx context.Context, ids []int64) (*Posts, error) {
	found := make(map[int64]Post, len(ids))
	var keys []string
	for _, id := range ids {
		if p, ok := e.Posts.Get(id); ok {
			found[id] = p
		} else {
			keys = append(keys, postKey(id))
		}
	}
	st := e.Stores()
	if len(keys) > 0 {
		cached, err := st.Memcached.GetMulti(ctx, keys)
		if err != nil {
			return nil, err
		}
		for _, v := range cached {
			var p Post
			if json.Unmarshal(v, &p) == nil {
				found[p.PostID] = p
				e.Posts.Put(p.PostID, p)
			}
		}
	}
	var missing []int64
	for _, id := range ids {
		if _, ok := found[id]; !ok {
			missing = append(missing, id)
		}
	}
	if len(missing) > 0 {
		rows, err := st.Postgres.Query(ctx, `SELECT body FROM posts WHERE post_id = ANY($1)`, missing)
		if err != nil {
			return nil, fmt.Errorf("read posts: %w", err)
		}
		bodies, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
		if err != nil {
			return nil, fmt.Errorf("read posts: %w", err)
		}
		for _, b := range bodies {
			var p Post
			if err := json.Unmarshal(b, &p); err != nil {
				return nil, fmt.Errorf("post body: %w", err)
			}
			found[p.PostID] = p
			e.Posts.Put(p.PostID, p)
			if err := st.Memcached.Set(ctx, postKey(p.PostID), b); err != nil {
				return nil, err
			}
		}
	}
	out := &Posts{Posts: make([]Post, 0, len(ids))}
	for _, id := range ids { // in the timeline's order; a post not found is left out
		if p, ok := found[id]; ok {
			out.Posts = append(out.Posts, p)
		}
	}
	return out, nil
}

func homeKey(id int64) string   { return "home-timeline:" + strconv.FormatInt(id, 10) }
func userKeyTL(id int64) string { return "user-timeline:" + strconv.FormatInt(id, 10) }

// addToTimelines puts a post on timelines (sorted sets scored by time) and trims them, in one
// Redis pipeline.
func addToTimelines(ctx context.Context, rdb *redis.Client, keys []string, w *TimelineWrite) error {
	_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, k := range keys {
			p.ZAdd(ctx, k, redis.Z{Score: float64(w.Timestamp), Member: w.PostID})
			p.ZRemRangeByRank(ctx, k, 0, -timelineLength-1)
		}
		return nil
	})
	return err
}

func checkRead(r *TimelineRead) error {
	if r.UserID <= 0 || r.Start < 0 || r.Stop <= r.Start || r.Stop-r.Start > maxRead {
		return badRequest("a timeline read needs user_id > 0 and 0 <= start < stop <= start+%d", maxRead)
	}
	return nil
}

func parseIDs(members []string) []int64 {
	ids := make([]int64, 0, len(members))
	for _, m := range members {
		if v, err := strconv.ParseInt(m, 10, 64); err == nil {
			ids = append(ids, v)
		}
	}
	return ids
}

// home-timeline-service: a post goes onto the home timelines of the author's followers and of
// the mentioned users (followers from social-graph); reads take post ids from Redis and the
// posts from post-storage.
var homeTimeline = Service{
	Name:  "home-timeline-service",
	Peers: []string{"social-graph-service", "post-storage-service"},
	Redis: true,
	Register: func(e *Env, s *rpc.Server) {
		rpc.Handle(s, "write_home_timeline", func(ctx context.Context, w *TimelineWrite) (*Empty, error) {
			var followers UserIDs
			if err := e.Peers.Call(ctx, "social-graph-service", "get_followers", UserRequest{UserID: w.UserID}, &followers); err != nil {
				return nil, err
			}
			keys := make([]string, 0, len(followers.UserIDs)+len(w.Mentioned))
			for _, id := range append(followers.UserIDs, w.Mentioned...) {
				keys = append(keys, homeKey(id))
			}
			if len(keys) == 0 {
				return &Empty{}, nil
			}
			return &Empty{}, addToTimelines(ctx, e.Stores().Redis, keys, w)
		})
		rpc.Handle(s, "read_home_timeline", func(ctx context.Context, r *TimelineRead) (*Posts, error) {
			if err := checkRead(r); err != nil {
				return nil, err
			}
			members, err := e.Stores().Redis.ZRevRange(ctx, homeKey(r.UserID), int64(r.Start), int64(r.Stop-1)).Result()
			if err != nil {
				return nil, err
			}
			return e.postsOf(ctx, parseIDs(members))
		})
	},
}

// postsOf reads posts from post-storage (none to read: no call).
func (e *Env) postsOf(ctx context.Context, ids []int64) (*Posts, error) {
	out := &Posts{Posts: []Post{}}
	if len(ids) == 0 {
		return out, nil
	}
	return out, e.Peers.Call(ctx, "post-storage-service", "read_posts", PostIDs{PostIDs: ids}, out)
}

// user-timeline-service: a user's own posts in a table and in a Redis sorted set; a read
// that finds the set empty rebuilds it from the table.
var userTimeline = Service{
	Name:     "user-timeline-service",
	Peers:    []string{"post-storage-service"},
	Redis:    true,
	Postgres: true,
	Schema: []string{`CREATE TABLE IF NOT EXISTS user_timeline (user_id BIGINT NOT NULL, post_id BIGINT NOT NULL,
		ts BIGINT NOT NULL, PRIMARY KEY (user_id, post_id))`},
	Register: func(e *Env, s *rpc.Server) {
		rpc.Handle(s, "write_user_timeline", func(ctx context.Context, w *TimelineWrite) (*Empty, error) {
			st := e.Stores()
			if _, err := st.Postgres.Exec(ctx, `INSERT INTO user_timeline VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`,
				w.UserID, w.PostID, w.Timestamp); err != nil {
				return nil, fmt.Errorf("write user timeline: %w", err)
			}
			return &Empty{}, addToTimelines(ctx, st.Redis, []string{userKeyTL(w.UserID)}, w)
		})
		rpc.Handle(s, "read_user_timeline", func(ctx context.Context, r *TimelineRead) (*Posts, error) {
			if err := checkRead(r); err != nil {
				return nil, err
			}
			ids, err := e.userTimelineIDs(ctx, r)
			if err != nil {
				return nil, err
			}
			return e.postsOf(ctx, ids)
		})
	},
}

func (e *Env) userTimelineIDs(ctx context.Context, r *TimelineRead) ([]int64, error) {
	st := e.Stores()
	key := userKeyTL(r.UserID)
	members, err := st.Redis.ZRevRange(ctx, key, int64(r.Start), int64(r.Stop-1)).Result()
	if err != nil || len(members) > 0 {
		return parseIDs(members), err
	}
	rows, err := st.Postgres.Query(ctx, `SELECT post_id, ts FROM user_timeline WHERE user_id = $1
		ORDER BY ts DESC LIMIT $2`, r.UserID, timelineLength)
	if err != nil {
		return nil, fmt.Errorf("read user timeline: %w", err)
	}
	type entry struct{ PostID, TS int64 }
	entries, err := pgx.CollectRows(rows, pgx.RowToStructByPos[entry])
	if err != nil || len(entries) == 0 {
		return nil, err
	}
	zs := make([]redis.Z, len(entries))
	for i, en := range entries {
		zs[i] = redis.Z{Score: float64(en.TS), Member: en.PostID}
	}
	if err := st.Redis.ZAdd(ctx, key, zs...).Err(); err != nil {
		return nil, err
	}
	var ids []int64
	for i := r.Start; i < r.Stop && i < len(entries); i++ {
		ids = append(ids, entries[i].PostID)
	}
	return ids, nil
}
