package app

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"bmeg.dev/testbed/internal/rpc"
)

// ComposePostRequest is what the front end sends compose-post-service.
type ComposePostRequest struct {
	ReqID      int64    `json:"req_id"`
	Username   string   `json:"username"`
	UserID     int64    `json:"user_id"`
	Text       string   `json:"text"`
	MediaIDs   []int64  `json:"media_ids"`
	MediaTypes []string `json:"media_types"`
	PostType   int      `json:"post_type"`
}

// compose-post-service: builds the post from text, creator, media and a unique id (asked
// together), then stores it and writes both timelines (together).
var composePost = Service{
	Name: "compose-post-service",
	Peers: []string{"text-service", "user-service", "media-service", "unique-id-service",
		"post-storage-service", "user-timeline-service", "home-timeline-service"},
	Register: func(e *Env, s *rpc.Server) {
		rpc.Handle(s, "compose_post", func(ctx context.Context, r *ComposePostRequest) (*Empty, error) {
			if r.UserID <= 0 || r.Username == "" {
				return nil, badRequest("compose_post needs user_id and username")
			}
			var (
				txt  ComposeTextResponse
				cr   Creator
				med  ComposeMediaResponse
				uid  UniqueIDResponse
				post Post
			)
			err := together(
				func() error {
					return e.Peers.Call(ctx, "text-service", "compose_text", ComposeTextRequest{ReqID: r.ReqID, Text: r.Text}, &txt)
				},
				func() error {
					return e.Peers.Call(ctx, "user-service", "compose_creator", Creator{UserID: r.UserID, Username: r.Username}, &cr)
				},
				func() error {
					return e.Peers.Call(ctx, "media-service", "compose_media", ComposeMediaRequest{IDs: r.MediaIDs, Types: r.MediaTypes}, &med)
				},
				func() error {
					return e.Peers.Call(ctx, "unique-id-service", "compose_unique_id", UniqueIDRequest{PostType: r.PostType}, &uid)
				})
			if err != nil {
				return nil, err
			}
			post = Post{PostID: uid.PostID, Creator: cr, ReqID: r.ReqID, Text: txt.Text,
				UserMentions: txt.UserMentions, Media: med.Media, URLs: txt.URLs,
				Timestamp: time.Now().UnixMilli(), PostType: r.PostType}
			mentioned := make([]int64, len(post.UserMentions))
			for i, m := range post.UserMentions {
				mentioned[i] = m.UserID
			}
			err = together(
				func() error { return e.Peers.Call(ctx, "post-storage-service", "store_post", post, nil) },
				func() error {
					return e.Peers.Call(ctx, "user-timeline-service", "write_user_timeline",
						TimelineWrite{UserID: r.UserID, PostID: post.PostID, Timestamp: post.Timestamp}, nil)
				},
				func() error {
					return e.Peers.Call(ctx, "home-timeline-service", "write_home_timeline",
						TimelineWrite{UserID: r.UserID, PostID: post.PostID, Timestamp: post.Timestamp, Mentioned: mentioned}, nil)
				})
			if err != nil {
				return nil, err
			}
			return &Empty{}, nil
		})
	},
}

// ComposeTextRequest asks text-service to process a post's text.
type ComposeTextRequest struct {
	ReqID int64  `json:"req_id"`
	Text  string `json:"text"`
}

// ComposeTextResponse is the text with its links shortened, its mentions and links.
type ComposeTextResponse struct {
	Text         string        `json:"text"`
	UserMentions []UserMention `json:"user_mentions"`
	URLs         []URL         `json:"urls"`
}

var (
	mentionPattern = regexp.MustCompile(`@[A-Za-z0-9_-]+`)
	urlPattern     = regexp.MustCompile(`https?://[^\s]+`)
)

// text-service: finds the mentions and links in a post's text, has them resolved and
// shortened (together), and puts the short links into the text.
var text = Service{
	Name:  "text-service",
	Peers: []string{"url-shorten-service", "user-mention-service"},
	Register: func(e *Env, s *rpc.Server) {
		rpc.Handle(s, "compose_text", func(ctx context.Context, r *ComposeTextRequest) (*ComposeTextResponse, error) {
			var names []string
			for _, m := range mentionPattern.FindAllString(r.Text, -1) {
				names = append(names, m[1:])
			}
			links := urlPattern.FindAllString(r.Text, -1)
			var urls ComposeURLsResponse
			var mentions ComposeMentionsResponse
			err := together(
				func() error {
					return e.Peers.Call(ctx, "url-shorten-service", "compose_urls", ComposeURLsRequest{URLs: links}, &urls)
				},
				func() error {
					return e.Peers.Call(ctx, "user-mention-service", "compose_user_mentions",
						ComposeMentionsRequest{Usernames: names}, &mentions)
				})
			if err != nil {
				return nil, err
			}
			out := r.Text
			for _, u := range urls.URLs {
				out = strings.Replace(out, u.ExpandedURL, u.ShortenedURL, 1)
			}
			return &ComposeTextResponse{Text: out, UserMentions: mentions.UserMentions, URLs: urls.URLs}, nil
		})
	},
}

// ComposeURLsRequest lists links to shorten.
type ComposeURLsRequest struct {
	URLs []string `json:"urls"`
}

// ComposeURLsResponse pairs each link with its short form.
type ComposeURLsResponse struct {
	URLs []URL `json:"urls"`
}

const shortURLPrefix = "http://short-url/"

// url-shorten-service: gives each link a random short form and stores the pairs.
var urlShorten = Service{
	Name:     "url-shorten-service",
	Postgres: true,
	Schema:   []string{`CREATE TABLE IF NOT EXISTS urls (shortened_url TEXT PRIMARY KEY, expanded_url TEXT NOT NULL)`},
	Register: func(e *Env, s *rpc.Server) {
		rpc.Handle(s, "compose_urls", func(ctx context.Context, r *ComposeURLsRequest) (*ComposeURLsResponse, error) {
			out := &ComposeURLsResponse{URLs: make([]URL, len(r.URLs))}
			if len(r.URLs) == 0 {
				return out, nil
			}
			shorts, longs := make([]string, len(r.URLs)), r.URLs
			for i, u := range r.URLs {
				shorts[i] = shortURLPrefix + randomToken(10)
				out.URLs[i] = URL{ShortenedURL: shorts[i], ExpandedURL: u}
			}
			_, err := e.Stores().Postgres.Exec(ctx,
				`INSERT INTO urls (shortened_url, expanded_url) SELECT * FROM unnest($1::text[], $2::text[])`, shorts, longs)
			if err != nil {
				return nil, fmt.Errorf("store urls: %w", err)
			}
			return out, nil
		})
	},
}

func randomToken(n int) string {
	const alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails on Linux
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	return string(b)
}

// ComposeMentionsRequest lists mentioned usernames.
type ComposeMentionsRequest struct {
	Usernames []string `json:"usernames"`
}

// ComposeMentionsResponse holds the mentions of existing users.
type ComposeMentionsResponse struct {
	UserMentions []UserMention `json:"user_mentions"`
}

// user-mention-service: resolves usernames to user ids, from memcached, then from the users
// table for the ones memcached lacks.
var userMention = Service{
	Name:     "user-mention-service",
	Memcache: true,
	Postgres: true,
	Schema:   []string{usersTable},
	Register: func(e *Env, s *rpc.Server) {
		rpc.Handle(s, "compose_user_mentions", func(ctx context.Context, r *ComposeMentionsRequest) (*ComposeMentionsResponse, error) {
			out := &ComposeMentionsResponse{UserMentions: []UserMention{}}
			if len(r.Usernames) == 0 {
				return out, nil
			}
			st := e.Stores()
			keys := make([]string, len(r.Usernames))
			for i, n := range r.Usernames {
				keys[i] = userKey(n)
			}
			cached, err := st.Memcached.GetMulti(ctx, keys)
			if err != nil {
				return nil, err
			}
			var missing []string
			for i, n := range r.Usernames {
				var u userRecord
				if v, ok := cached[keys[i]]; ok && json.Unmarshal(v, &u) == nil {
					out.UserMentions = append(out.UserMentions, UserMention{UserID: u.UserID, Username: n})
				} else {
					missing = append(missing, n)
				}
			}
			if len(missing) == 0 {
				return out, nil
			}
			rows, err := st.Postgres.Query(ctx, `SELECT user_id, username FROM users WHERE username = ANY($1)`, missing)
			if err != nil {
				return nil, fmt.Errorf("find users: %w", err)
			}
			found, err := pgx.CollectRows(rows, pgx.RowToStructByPos[UserMention])
			if err != nil {
				return nil, fmt.Errorf("find users: %w", err)
			}
			out.UserMentions = append(out.UserMentions, found...)
			return out, nil
		})
	},
}

// UniqueIDRequest asks for a post id.
type UniqueIDRequest struct {
	PostType int `json:"post_type"`
}

// UniqueIDResponse carries a new post id.
type UniqueIDResponse struct {
	PostID int64 `json:"post_id"`
}

// snowflake makes ids as DeathStarBench's unique-id-service does: milliseconds since an
// epoch, a machine id (from the instance, so replicas differ) and a per-millisecond counter.
type snowflake struct {
	mu      sync.Mutex
	machine int64
	lastMS  int64
	counter int64
}

const snowflakeEpochMS = 1514764800000 // 2018-01-01, as in DeathStarBench

func (s *snowflake) next() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	ms := time.Now().UnixMilli() - snowflakeEpochMS
	if ms <= s.lastMS { // same millisecond (or the clock stepped back): count on
		ms = s.lastMS
		s.counter++
		if s.counter >= 1<<12 {
			ms++
			s.counter = 0
		}
	} else {
		s.counter = 0
	}
	s.lastMS = ms
	return ms<<22 | s.machine<<12 | s.counter
}

var uniqueID = Service{
	Name: "unique-id-service",
	Register: func(e *Env, s *rpc.Server) {
		h := fnv.New32a()
		_, _ = h.Write([]byte(e.Instance)) // hash.Hash.Write never fails
		ids := &snowflake{machine: int64(h.Sum32() % 1024)}
		rpc.Handle(s, "compose_unique_id", func(_ context.Context, _ *UniqueIDRequest) (*UniqueIDResponse, error) {
			return &UniqueIDResponse{PostID: ids.next()}, nil
		})
	},
}

// ComposeMediaRequest lists a post's attachments.
type ComposeMediaRequest struct {
	IDs   []int64  `json:"media_ids"`
	Types []string `json:"media_types"`
}

// ComposeMediaResponse is the attachments paired up.
type ComposeMediaResponse struct {
	Media []Media `json:"media"`
}

var media = Service{
	Name: "media-service",
	Register: func(e *Env, s *rpc.Server) {
		rpc.Handle(s, "compose_media", func(_ context.Context, r *ComposeMediaRequest) (*ComposeMediaResponse, error) {
			if len(r.IDs) != len(r.Types) {
				return nil, badRequest("%d media ids but %d media types", len(r.IDs), len(r.Types))
			}
			out := &ComposeMediaResponse{Media: make([]Media, len(r.IDs))}
			for i := range r.IDs {
				out.Media[i] = Media{MediaID: r.IDs[i], MediaType: r.Types[i]}
			}
			return out, nil
		})
	},
}
